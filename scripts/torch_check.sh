#!/usr/bin/env bash
# Runs the package on another supported torch than CI's, on this CPU machine:
#
#   scripts/torch_check.sh VERSION OUT_DIR      e.g. 2.11.0 (the GPU machine's +cu130 build),
#                                               2.14.1 (a CUDA build that lies on disk)
#                                               or 2.15.0 (from the index, past pip's cap)
#
# 1. A venv with that torch (${DMUON_TORCH_VENVS:-.venvs}/torch-VERSION, made once, ~4.7 GB for
#    2.11.0: a CUDA build runs on a machine without a GPU, torch.cuda.is_available() False),
#    the project installed editable around it with the tested versions of
#    scripts/constraints.txt (TorchTitan 0.2.2) and the test extra; triton is the one that
#    torch build requires.
# 2. The GPU lease at toy size on the CPU (LEASE_DEVICE=cpu bash benchmarks/gpu_lease.sh):
#    OUT_DIR/lease/gpu_lease.{json,md,log}.
# 3. The engine's and the optimizer's tests (TESTS: pytest's arguments; default: every test
#    but TorchTitan's training runs and the benchmarks'): OUT_DIR/pytest.log.
#
# CI keeps its one torch (scripts/setup.sh); this is run by hand for each supported torch,
# and its results go into the note of the change that needed it. Exit status: 0 when both
# the lease and the tests passed, 1 otherwise, 2 on bad usage.
set -uo pipefail

if [[ $# -ne 2 || "$1" == -* ]]; then
  echo "usage: $0 TORCH_VERSION OUT_DIR   (e.g. 2.11.0 /tmp/torch-2.11)" >&2
  exit 2
fi
version="$1"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
mkdir -p "$2"
out="$(cd "$2" && pwd)"
venv="${DMUON_TORCH_VENVS:-$ROOT/.venvs}/torch-$version"
PY="$venv/bin/python"
log() { echo "[torch_check] $*" >&2; }

if [[ ! -f "$venv/.dmuon-ready" ]]; then
  log "making $venv (torch==$version, then the project around it)"
  rm -rf "$venv"
  python3 -m venv "$venv" || exit 1
  pip=("$PY" -m pip --disable-pip-version-check -q)
  # A torch above the cap the machine's pip config sets (/etc/xdg/pip: torch<=2.14.1, the
  # releases on its disk), 2.15 say, comes from the index: this venv's installs set that
  # config aside (the machine's file stays as it is).
  if [[ "$(printf '%s\n' "$version" 2.14.1 | sort -V | tail -1)" != 2.14.1 ]]; then
    pip=(env PIP_CONFIG_FILE=/dev/null "${pip[@]}")
  fi
  "${pip[@]}" install "torch==$version" || exit 1
  constraints="$(mktemp)"
  # The public version: a local label (+cu130) in a constraint matches no candidate.
  echo "torch==$("$PY" -c 'import torch; print(torch.__version__.split("+")[0])')" >"$constraints"
  cat "$ROOT/scripts/constraints.txt" >>"$constraints" # the tested versions
  "${pip[@]}" install -c "$constraints" -e "$ROOT[test]" || exit 1
  rm -f "$constraints"
  touch "$venv/.dmuon-ready"
fi
"$ROOT/scripts/setup.sh" >/dev/null || exit 1 # the offline assets the lease trains on
"$PY" -c 'import sys, torch, triton
print(f"[torch_check] torch {torch.__version__}, triton {triton.__version__}, "
      f"cuda available {torch.cuda.is_available()}, cpu capability "
      f"{torch.backends.cpu.get_cpu_capability()}, python {sys.version.split()[0]}")' \
  | tee "$out/versions.txt"

cd "$ROOT"
log "the lease at toy size on the CPU -> $out/lease"
# The budget is the GPU's 7 minutes; on 2 CPU cores the toy steps (compile on Inductor's CPU
# backend above all) take longer, so that every step runs here.
LEASE_DEVICE=cpu LEASE_BUDGET_S="${LEASE_BUDGET_S:-1500}" PYTHON="$PY" \
  bash benchmarks/gpu_lease.sh "$out/lease"
lease_rc=$?

# TESTS: pytest's arguments (files or folders, options), all of them: a folder named here
# beside files would collect the whole folder.
read -r -a tests <<<"${TESTS:-tests --ignore=tests/titan --ignore-glob=tests/tools/test_bench_*}"
log "pytest ${tests[*]} -> $out/pytest.log"
"$PY" -m pytest -q -p no:cacheprovider "${tests[@]}" >"$out/pytest.log" 2>&1
tests_rc=$?
tail -n 30 "$out/pytest.log"
log "torch $version: lease exit $lease_rc, tests exit $tests_rc"
[[ "$lease_rc" == 0 && "$tests_rc" == 0 ]]
