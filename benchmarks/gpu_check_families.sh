#!/usr/bin/env bash
# The model families at their published sizes (Qwen2.5-1.5B / 7B, Mistral-7B, Llama-3.2-3B
# through TorchTitan's HF backend), which a CPU cannot train: DMuon (the configs' bf16
# Newton-Schulz where the GPU has it) and AdamW, 20 steps each, FSDP over every GPU, with
# benchmarks/bench_families.py. A size that does not fit fails alone, its error kept.
# Results: OUT_DIR/results.json, loss_curves.png and families.log.
# Usage: bash benchmarks/gpu_check_families.sh OUT_DIR   (or with $OUT set); PYTHON picks
# the interpreter (default .venv/bin/python).
set -uo pipefail
source "$(dirname "$0")/gpu_check_out.sh"
py="${PYTHON:-.venv/bin/python}"
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
[ "$gpus" -ge 1 ] || { echo "no GPU (nvidia-smi -L lists none)" | tee "$out/families.log"; exit 0; }
"$py" benchmarks/bench_families.py --families qwen2.5-1.5B llama3.2-3B qwen2.5-7B mistral-7B \
  --nproc "$gpus" --steps 20 --ns-dtype auto --timeout 1200 --out "$out" \
  2>&1 | tee "$out/families.log"
