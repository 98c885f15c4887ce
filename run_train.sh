#!/usr/bin/env bash
# Sets up the environment if needed (scripts/setup.sh), then trains with TorchTitan + DMuon.
#
#   ./run_train.sh                                  # the embedded default: train_configs/debug_cpu.toml
#   NGPU=4 ./run_train.sh --job.config_file train_configs/X.toml --section.key value ...
#
# NGPU: processes to launch on this node (default: the GPUs CUDA_VISIBLE_DEVICES lists, else
# every GPU nvidia-smi -L lists, MIG slices not counted; 2 CPU processes on gloo where there
# is no GPU). LOG_RANK: the local ranks whose output is shown (default 0). The command
# launched is printed first; PYTORCH_ALLOC_CONF defaults to expandable_segments:True.
# COMM_MODE=fake_backend: TorchTitan's dry run, one process standing for NGPU ranks on a
# fake process group, one step (NGPU=1024 COMM_MODE=fake_backend ./run_train.sh ...).
# The config file named last on the command line is the one used (TorchTitan's own parser
# would silently keep the first); every other argument is passed to TorchTitan as an
# override.
#
# TorchTitan 0.3 (TORCHTITAN_VERSION=0.3.0, its own venv, set up on first use):
#   TORCHTITAN_VERSION=0.3.0 ./run_train.sh         # --module torchtitan_dmuon.titan03
#                                                   # --config llama3_debug_cpu
#   TORCHTITAN_VERSION=0.3.0 ./run_train.sh --module M --config F --section.key value ...
#   TORCHTITAN_VERSION=0.3.0 ./run_train.sh --job.config_file X.toml ...   # translated
# (--module torchtitan_dmuon.titan03 --config <any TorchTitan config function> is that
# config with DMuon; 0.3 reads no TOML: a file's keys go where 0.3 keeps them, and one 0.3
# does not have is refused by name: docs/torchtitan-0.3.md.)
#
# Several nodes (run the same command on each, as multinode_trainer.slurm does):
#   NNODES: the number of nodes (default 1: this machine alone).
#   NODE_RANK with MASTER_ADDR (and MASTER_PORT, default 29500): a static rendezvous; node
#     r's processes get the global ranks r * NGPU ... r * NGPU + NGPU - 1.
#   or RDZV_ENDPOINT (host:port, and RDZV_ID, default torchtitan-dmuon): torchrun's c10d
#     rendezvous, as TorchTitan's slurm script uses; ranks follow the order nodes join.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$ROOT"
source scripts/torchtitan_env.sh # TORCHTITAN_VERSION, VENV

CONFIG_FILE="${CONFIG_FILE:-train_configs/debug_cpu.toml}"
overrides=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --job.config_file | --job.config-file)
      [[ $# -ge 2 ]] || { echo "run_train.sh: $1 needs a file" >&2; exit 2; }
      CONFIG_FILE="$2"
      config_file_given=1
      shift 2
      ;;
    --job.config_file=* | --job.config-file=*)
      CONFIG_FILE="${1#*=}"
      config_file_given=1
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
if [[ "$TORCHTITAN_VERSION" == 0.3.0 ]]; then
  # TorchTitan 0.3's own entry point; a config module names the job. A TOML file (0.3 reads
  # none) is translated onto 0.3's config by the config function from_toml (titan03/toml.py).
  if [[ -n "${config_file_given:-}" ]]; then
    [[ -f "$CONFIG_FILE" ]] || { echo "run_train.sh: config file not found: $CONFIG_FILE" >&2; exit 2; }
    export TORCHTITAN_DMUON_CONFIG_FILE="$CONFIG_FILE"
    overrides=(--module torchtitan_dmuon.titan03 --config from_toml ${overrides[@]+"${overrides[@]}"})
  fi
  [[ " ${overrides[*]-} " =~ [[:space:]]--module[=[:space:]] ]] || overrides=(--module torchtitan_dmuon.titan03 ${overrides[@]+"${overrides[@]}"})
  [[ " ${overrides[*]-} " =~ [[:space:]]--config[=[:space:]] ]] || overrides+=(--config llama3_debug_cpu)
  entry=(-m torchtitan.train)
else
  # The [dmuon] section comes from TorchTitan's custom_config_module mechanism.
  [[ -n "${config_module_given:-}" ]] || overrides+=(--job.custom_config_module torchtitan_dmuon.titan.config)
  [[ -f "$CONFIG_FILE" ]] || { echo "run_train.sh: config file not found: $CONFIG_FILE" >&2; exit 2; }
  entry=(-m torchtitan_dmuon.titan.train --job.config_file "$CONFIG_FILE")
fi

if [[ -z "${NGPU:-}" ]]; then
  if [[ -n "${CUDA_VISIBLE_DEVICES:-}" ]]; then
    # The GPUs this job may use (torch numbers them 0..n-1 whatever the list says).
    IFS=, read -r -a visible <<<"$CUDA_VISIBLE_DEVICES"
    NGPU="${#visible[@]}"
  elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    # Physical GPUs only: nvidia-smi -L also lists each one's MIG slices, indented.
    NGPU="$(nvidia-smi -L | grep -c '^GPU ' || true)"
  fi
  [[ "${NGPU:-0}" -gt 0 ]] || NGPU=2
fi

NNODES="${NNODES:-1}"
[[ "$NNODES" =~ ^[1-9][0-9]*$ ]] || { echo "run_train.sh: NNODES must be a positive integer, got '$NNODES'" >&2; exit 2; }
if [[ "$NNODES" == 1 ]]; then
  launch=(--rdzv_backend c10d --rdzv_endpoint "localhost:0")
elif [[ -n "${NODE_RANK:-}" ]]; then
  [[ "$NODE_RANK" =~ ^[0-9]+$ && "$NODE_RANK" -lt "$NNODES" ]] || { echo "run_train.sh: NODE_RANK must be in [0, $NNODES), got '$NODE_RANK'" >&2; exit 2; }
  [[ -n "${MASTER_ADDR:-}" ]] || { echo "run_train.sh: NODE_RANK needs MASTER_ADDR (the address of node 0)" >&2; exit 2; }
  launch=(--nnodes "$NNODES" --node_rank "$NODE_RANK" --master_addr "$MASTER_ADDR" --master_port "${MASTER_PORT:-29500}")
elif [[ -n "${RDZV_ENDPOINT:-}" ]]; then
  launch=(--nnodes "$NNODES" --rdzv_backend c10d --rdzv_endpoint "$RDZV_ENDPOINT" --rdzv_id "${RDZV_ID:-torchtitan-dmuon}")
else
  echo "run_train.sh: NNODES=$NNODES needs NODE_RANK and MASTER_ADDR, or RDZV_ENDPOINT" >&2
  exit 2
fi

# Under TP or owner groups a gloo group beside each such NCCL group (at most a node's ranks)
# agrees before the step's second phase: gloo takes the interface NCCL is told to take.
if [[ "$NNODES" -gt 1 && -n "${NCCL_SOCKET_IFNAME:-}" ]]; then
  export GLOO_SOCKET_IFNAME="${GLOO_SOCKET_IFNAME:-$NCCL_SOCKET_IFNAME}"
fi

# As TorchTitan's run_train.sh: fewer out-of-memory errors from fragmentation on CUDA.
export PYTORCH_ALLOC_CONF="${PYTORCH_ALLOC_CONF:-expandable_segments:True}"
if [[ -n "${COMM_MODE:-}" ]]; then
  # TorchTitan's dry run: one process stands for NGPU ranks on a fake process group
  # (nothing is communicated): config, model, parallelisms and DMuon's plan are built and
  # one step runs. Its peak memory is the point: glibc keeps freed blocks below its
  # adaptive mmap threshold (up to 32 MiB) in the heap, which a dry run's resident size
  # would count (the 8B dry run at 1024 with owner groups: 13.6 GiB, 8.8 GiB with this).
  export MALLOC_MMAP_THRESHOLD_="${MALLOC_MMAP_THRESHOLD_:-1048576}"
  export LOCAL_RANK=0 NGPU
  command=("$VENV/bin/python" "${entry[@]}"
    ${overrides[@]+"${overrides[@]}"} --comm.mode "$COMM_MODE" --training.steps 1)
else
  command=("$VENV/bin/torchrun" --nproc_per_node="$NGPU" "${launch[@]}"
    --local-ranks-filter "${LOG_RANK:-0}" --role rank --tee 3
    "${entry[@]}" ${overrides[@]+"${overrides[@]}"})
fi
echo "run_train.sh: NGPU=$NGPU PYTORCH_ALLOC_CONF=$PYTORCH_ALLOC_CONF ${command[*]}" >&2
# TorchTitan's HF backend imports transformers, which the other models do not need.
hf_backend=transformers_modeling_backend
if [[ "$TORCHTITAN_VERSION" == 0.2.2 ]] && grep -Eq "^[[:space:]]*name[[:space:]]*=[[:space:]]*\"$hf_backend\"" "$CONFIG_FILE" \
    || [[ " ${overrides[*]-} " =~ [[:space:]]--model\.name[=[:space:]]$hf_backend[[:space:]] ]]; then
  ./scripts/setup.sh --hf
else
  ./scripts/setup.sh
fi
exec "${command[@]}"
