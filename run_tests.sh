#!/usr/bin/env bash
# Sets up the environment if needed (scripts/setup.sh), then lints and runs the tests.
#   ./run_tests.sh            the whole suite with this machine's ns_dtype="auto" verdict,
#                             then the tests that read the verdict (marker ns_verdict) again
#                             with the other kind of CPU's (TORCHTITAN_DMUON_AUTO_NS_DTYPE)
#   ./run_tests.sh ARGS...    pytest over tests/ with ARGS only, e.g. -m "not slow" -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
./scripts/setup.sh --dev
PY="${DMUON_VENV:-$ROOT/.venv}/bin/python"
"$PY" -m ruff check .
if [[ $# -gt 0 ]]; then
  exec "$PY" -m pytest tests "$@"
fi
"$PY" -m pytest tests
other="$("$PY" -c 'import torch
from tests.support.ns_verdict import other_verdict
print(other_verdict(torch.device("cpu")))')"
echo "[tests] the ns_verdict tests again as a CPU whose ns_dtype='auto' picks $other:"
echo "[tests] TORCHTITAN_DMUON_AUTO_NS_DTYPE=$other"
TORCHTITAN_DMUON_AUTO_NS_DTYPE="$other" exec "$PY" -m pytest tests -m ns_verdict
