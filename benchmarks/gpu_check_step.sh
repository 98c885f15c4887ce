#!/usr/bin/env bash
# One-GPU step benchmark for when an accelerator is lent, in under 7 minutes:
#   1. DMuon vs FSDP2+AdamW vs naive FSDP2+Muon (and the peers) on the debug-size model,
#   2. the same on a ~1B llama3-style model (dim 2048, 16 layers, 2 x 2048 tokens),
#   3. the Newton-Schulz backend table (bench_ns.py),
#   4. with 2 or more GPUs, TorchTitan runs with context and pipeline parallelism.
# Same output format as on CPU (results.json + step_time.png per model, bench_ns.json).
# Usage: bash benchmarks/gpu_check_step.sh OUT_DIR   (or with $OUT set); PYTHON picks the
# interpreter (default .venv/bin/python). QUICK=1 shrinks everything (a CPU dry run).
set -uo pipefail
source "$(dirname "$0")/gpu_check_out.sh"
py="${PYTHON:-.venv/bin/python}"
status=0
if [ -n "${QUICK:-}" ]; then
  debug=(--dim 64 --layers 2 --heads 4 --vocab 256 --seq 16 --rounds 1 --steps-per-round 1)
  large=(--dim 128 --layers 2 --heads 4 --vocab 256 --seq 32 --rounds 1 --steps-per-round 1)
  ns=(--quick --reps 1)
else
  debug=(--dim 256 --layers 4 --heads 8 --seq 120 --batch 2)
  large=(--dim 2048 --layers 16 --heads 16 --vocab 32768 --seq 2048 --batch 2 --rounds 3)
  ns=()
fi
echo "== debug model" | tee "$out/debug.log"
timeout 120 "$py" benchmarks/bench_step.py --nproc 1 "${debug[@]}" --out "$out/debug" \
  2>&1 | tee -a "$out/debug.log" || status=1
echo "== ~1B model" | tee "$out/1b.log"
timeout 180 "$py" benchmarks/bench_step.py --nproc 1 "${large[@]}" --out "$out/1b" \
  2>&1 | tee -a "$out/1b.log" || status=1
echo "== Newton-Schulz backends" | tee "$out/ns.log"
timeout 80 "$py" benchmarks/bench_ns.py "${ns[@]}" --out "$out/ns" 2>&1 | tee -a "$out/ns.log" || status=1
# Context and pipeline parallelism through TorchTitan need 2 GPUs (CP cannot run on CPU:
# its attention needs SDPA's flash kernel); DMuon and AdamW, 10 steps each.
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
if [ "$gpus" -ge 2 ] && [ -z "${QUICK:-}" ]; then
  short=(--training.steps 10 --metrics.log_freq 1)
  for optimizer in DMuon AdamW; do
    echo "== CP 2, $optimizer" | tee -a "$out/cp_pp.log"
    NGPU=2 timeout 150 ./run_train.sh "${short[@]}" --optimizer.name "$optimizer" \
      --parallelism.context_parallel_degree 2 --job.dump_folder "$out/cp_$optimizer" \
      2>&1 | tee -a "$out/cp_pp.log" || status=1
    echo "== PP 2 (1F1B), $optimizer" | tee -a "$out/cp_pp.log"
    NGPU=2 LOG_RANK=1 timeout 150 ./run_train.sh "${short[@]}" --optimizer.name "$optimizer" \
      --parallelism.pipeline_parallel_degree 2 --parallelism.pipeline_parallel_schedule 1F1B \
      --job.dump_folder "$out/pp_$optimizer" 2>&1 | tee -a "$out/cp_pp.log" || status=1
  done
else
  echo "== CP / PP through TorchTitan: skipped ($gpus GPU(s); they need 2)" | tee "$out/cp_pp.log"
fi
exit $status
