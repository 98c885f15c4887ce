# Sourced by scripts/setup.sh, run_train.sh and run_tests.sh (which set ROOT): the TorchTitan
# release to work beside (TORCHTITAN_VERSION: 0.2.2, the default, or 0.3.0) and its venv
# (DMUON_VENV overrides: .venv for 0.2.2, .venvs/torchtitan-0.3.0 for 0.3.0).
TORCHTITAN_VERSION="${TORCHTITAN_VERSION:-0.2.2}"
case "$TORCHTITAN_VERSION" in
  0.2.2) VENV="${DMUON_VENV:-$ROOT/.venv}" ;;
  0.3.0) VENV="${DMUON_VENV:-$ROOT/.venvs/torchtitan-0.3.0}" ;;
  *)
    echo "TORCHTITAN_VERSION=$TORCHTITAN_VERSION: torchtitan-dmuon works beside TorchTitan 0.2.2 (the default) and 0.3.0" >&2
    exit 2
    ;;
esac
export TORCHTITAN_VERSION
