#!/usr/bin/env bash
# Sets up the environment if needed (scripts/setup.sh), then lints and runs the whole test
# suite. Extra arguments go to pytest, e.g. ./run_tests.sh -m "not slow" -x
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
./scripts/setup.sh
PY="${DMUON_VENV:-$ROOT/.venv}/bin/python"
"$PY" -m ruff check .
exec "$PY" -m pytest tests "$@"
