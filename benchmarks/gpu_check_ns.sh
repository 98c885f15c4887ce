#!/usr/bin/env bash
# Newton-Schulz backends on a CUDA machine, in one command of under 5 minutes:
#   1. correctness of torch / triton / gram / auto at realistic sizes, bf16 and TF32
#      (benchmarks/check_ns_cuda.py -> check_ns_cuda.json, check.log),
#   2. the benchmark table (benchmarks/bench_ns.py -> bench_ns.json, bench_ns.txt, bench.log),
#   3. the NS test files on the GPU, with whatever time is left (pytest.log).
# Usage, from anywhere:  bash benchmarks/gpu_check_ns.sh OUT_DIR   (or with $OUT set)
# PYTHON selects the interpreter (default python3, the one that holds a CUDA torch).
# Exit status: 0 when every step passed, 1 otherwise; the logs say which.
set -uo pipefail

source "$(dirname "$0")/gpu_check_out.sh"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"
start=$SECONDS
status=0

"$py" -c "import torch, triton; assert torch.cuda.is_available(), 'no CUDA device'; \
print(torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" \
    2>&1 | tee "$out/env.log" || exit 1

echo "== correctness (check_ns_cuda.py)"
timeout 130 "$py" benchmarks/check_ns_cuda.py --out "$out" 2>&1 | tee "$out/check.log" || status=1

echo "== benchmark (bench_ns.py)"
timeout 110 "$py" benchmarks/bench_ns.py --out "$out" 2>&1 | tee "$out/bench.log" || status=1

left=$((290 - (SECONDS - start)))
if [ "$left" -gt 20 ]; then
    echo "== tests on the GPU (${left}s left)"
    timeout "$left" "$py" -m pytest -q -p no:cacheprovider \
        tests/test_ns_triton.py tests/test_ns_gram.py tests/test_newton_schulz.py \
        2>&1 | tee "$out/pytest.log" || status=1
else
    echo "== tests skipped: ${left}s left" | tee "$out/pytest.log"
fi

echo "== done in $((SECONDS - start))s, status $status"
exit $status
