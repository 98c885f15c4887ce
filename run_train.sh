#!/usr/bin/env bash
# Sets up the environment if needed (scripts/setup.sh), then trains with TorchTitan + DMuon.
#
#   ./run_train.sh                                  # the embedded default: train_configs/debug_cpu.toml
#   NGPU=4 ./run_train.sh --job.config_file train_configs/X.toml --section.key value ...
#
# NGPU: processes to launch (default: every local GPU, or 2 CPU processes on gloo where
# there is no GPU). LOG_RANK: the ranks whose output is shown (default 0). The config file
# named last on the command line is the one used (TorchTitan's own parser would silently
# keep the first); every other argument is passed to TorchTitan as an override.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
./scripts/setup.sh
VENV="${DMUON_VENV:-$ROOT/.venv}"

CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_cpu.toml}"
overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --job.config_file | --job.config-file)
      [[ $# -ge 2 ]] || { echo "run_train.sh: $1 needs a file" >&2; exit 2; }
      CONFIG_FILE="$2"
      shift 2
      ;;
    --job.config_file=* | --job.config-file=*)
      CONFIG_FILE="${1#*=}"
      shift
      ;;
    --job.custom_config_module | --job.custom-config-module | --job.custom_config_module=* | --job.custom-config-module=*)
      config_module_given=1
      overrides+=("$1")
      shift
      ;;
    *)
      overrides+=("$1")
      shift
      ;;
  esac
done
# The [dmuon] section comes from TorchTitan's custom_config_module mechanism.
[[ -n "${config_module_given:-}" ]] || overrides+=(--job.custom_config_module torchtitan_dmuon.titan.config)
[[ -f "$CONFIG_FILE" ]] || { echo "run_train.sh: config file not found: $CONFIG_FILE" >&2; exit 2; }

if [[ -z "${NGPU:-}" ]]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    NGPU="$(nvidia-smi -L | wc -l)"
  else
    NGPU=2
  fi
fi

exec "$VENV/bin/torchrun" --nproc_per_node="$NGPU" --rdzv_backend c10d \
  --rdzv_endpoint="localhost:0" --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3 \
  -m torchtitan_dmuon.titan.train --job.config_file "$CONFIG_FILE" ${overrides[@]+"${overrides[@]}"}
