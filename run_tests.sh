#!/usr/bin/env bash
# Sets up the environment if needed (scripts/setup.sh), then lints and runs the tests.
#   ./run_tests.sh            the whole suite with this machine's ns_dtype="auto" verdict,
#                             then the tests that read the verdict (marker ns_verdict) again
#                             with the other kind of CPU's (TORCHTITAN_DMUON_AUTO_NS_DTYPE),
#                             then the TorchTitan 0.3 adapter's (as below)
#   ./run_tests.sh ARGS...    pytest over tests/ with ARGS only, e.g. -m "not slow" -x
#   TORCHTITAN_VERSION=0.3.0 ./run_tests.sh [ARGS...]
#                             the TorchTitan 0.3 adapter's tests (tests/titan03) in its own
#                             venv (scripts/setup.sh), beside TorchTitan 0.3.0
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
source scripts/torchtitan_env.sh # TORCHTITAN_VERSION, VENV
./scripts/setup.sh --dev
PY="$VENV/bin/python"
"$PY" -m ruff check .
# The whole suite in two pytest workers, one test file at a time each (a file's tests share
# their launches: shared_run): a launch's start and its one-process phases leave a core idle.
WORKERS=(-n 2 --dist loadfile)
if [[ "$TORCHTITAN_VERSION" == 0.3.0 ]]; then
  [[ $# -gt 0 ]] || set -- "${WORKERS[@]}"
  exec "$PY" -m pytest tests/titan03 "$@"
fi
if [[ $# -gt 0 ]]; then
  exec "$PY" -m pytest tests "$@"
fi
"$PY" -m pytest tests "${WORKERS[@]}"
other="$("$PY" -c 'import torch
from tests.support.ns_verdict import other_verdict
print(other_verdict(torch.device("cpu")))')"
echo "[tests] the ns_verdict tests again as a CPU whose ns_dtype='auto' picks $other:"
echo "[tests] TORCHTITAN_DMUON_AUTO_NS_DTYPE=$other"
TORCHTITAN_DMUON_AUTO_NS_DTYPE="$other" "$PY" -m pytest tests -m ns_verdict
echo "[tests] the TorchTitan 0.3 adapter's tests, beside TorchTitan 0.3.0:"
exec env -u DMUON_VENV TORCHTITAN_VERSION=0.3.0 ./run_tests.sh
