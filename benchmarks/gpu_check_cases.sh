#!/usr/bin/env bash
# TorchTitan v0.2.2's cases that cannot run on CPU for any optimizer (FlexAttention has no
# CPU backward; SDPA's CPU kernels have no DTensor rule under TP or CP; DualPipeV needs an
# accelerator), with DMuon and AdamW through benchmarks/titan_cases.py, for a machine with
# enough GPUs: each case runs only where `nvidia-smi -L` lists at least its ranks (4 or 8);
# the others are listed as skipped. Results: OUT_DIR/results.json and table.md (as on CPU).
# Usage: bash benchmarks/gpu_check_cases.sh OUT_DIR   (or with $OUT set); PYTHON picks the
# interpreter (default .venv/bin/python).
set -uo pipefail
source "$(dirname "$0")/gpu_check_out.sh"
py="${PYTHON:-.venv/bin/python}"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
declare -A ranks=(
  [deepseek_v3_flex+pp+fsdp+ep+sacop]=8 [gpt_oss_fsdp+tp+ep+compile]=8 [qwen3_fsdp+tp]=4
  [qwen3_fsdp+tp+ep+etp]=4 [hsdp+cp_with_dp_shard]=8 [pp_dualpipev]=4 [fsdp+tp+cp]=8
  [cpu_offload+opt_in_bwd+TP+DP+CP]=8 [validation_tp_cp_pp]=8
)
runnable=()
for case in "${!ranks[@]}"; do
  if [ "$gpus" -ge "${ranks[$case]}" ]; then
    runnable+=("$case")
  else
    echo "skipped $case: needs ${ranks[$case]} GPUs, this machine has $gpus" | tee -a "$out/skipped.txt"
  fi
done
[ "${#runnable[@]}" -gt 0 ] || { echo "no case fits $gpus GPU(s)"; exit 0; }
"$py" benchmarks/titan_cases.py --cases "${runnable[@]}" --out "$out" --dumps "$out/runs" \
  2>&1 | tee "$out/cases.log"
