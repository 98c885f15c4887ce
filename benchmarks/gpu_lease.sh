#!/usr/bin/env bash
# Everything one GPU can tell about DMuon, in one command of at most 7 minutes, on a machine
# as the device tool lends it (one H100 or H200, its image's python3 with torch and triton,
# no venv, no network; docs/gpu.md), so that one lease of 15 device-minutes answers in one try
# with room for the machine's start, the transfers and a second run:
#
#   bash benchmarks/gpu_lease.sh OUT_DIR            # or with $OUT set
#   QUICK=1 bash benchmarks/gpu_lease.sh OUT_DIR    # no GPU: a check of this script (< 60 s)
#
# Steps, in the order of what only a GPU can answer, each under its own `timeout` and the
# whole under LEASE_BUDGET_S (default 420 s); a failure or a missing package ends its step
# (recorded, with its error), not the script, and a step that would not fit is skipped:
#   wheels       the wheels of scripts/gpu_wheels.txt (made by scripts/gpu_wheels.sh and
#                carried in .gpu_wheels/, GPU_WHEELS names another folder) installed with
#                pip install --no-index --no-deps --target into a scratch folder, which
#                goes on PYTHONPATH after the repository
#   assets       the offline corpus and tokenizer (torchtitan_dmuon/titan/assets.py), if absent
#   env          GPU, Python, torch, triton, NCCL, the packages' versions and origins, and
#                every import the steps need (benchmarks/gpu_lease.py env)
#   engine       the engine over NCCL at world size 1 (every collective path, on its streams
#                with real device work; recovery from a failed backward and a failed step)
#                and 2 or 4 processes sharing the GPU over gloo (FSDP Z2/Z3, HSDP 2x2 async),
#                each against one-process torch.optim.Muon (gpu_lease.py engine)
#   syncs        host syncs per step under torch.cuda.set_sync_debug_mode("warn"), forward,
#                backward, step and zero_grad apart: DMuon and FSDP2 + fused AdamW
#   ns           the Newton-Schulz backends (torch, Triton compiled, gram, auto) in bf16 and
#                fp32/TF32 at two of Llama-3 8B's shapes: times, speed against torch, error
#                against fp64 (gpu_lease.py ns)
#   titan_DMuon  TorchTitan, a ~1B llama3 as the repo's GPU configs ship it (bf16, selective
#   titan_AdamW  AC) on one GPU, eager, TITAN_STEPS (20) steps with each optimizer: tokens/s,
#                MFU, peak memory, loss, the dmuon: lines (gpu_lease.py titan)
#   titan_DMuon_compiled, titan_AdamW_compiled   the same with torch.compile
#   titan_DMuon_float8  the same with float8 linears (torchao, torch._scaled_mm), 10 steps
# Results in OUT_DIR (three files, as the device tool brings back at most eight):
# gpu_lease.json (every figure), gpu_lease.md (a table per step) and gpu_lease.log (all
# output), the JSON and the table rewritten as each step ends, so that a run cut off still
# answers for the steps before. PYTHON picks the interpreter (default: the repository's
# .venv where there is one, else python3, the GPU machine's). Exit status: 0 when no step
# failed (skipped and unsupported ones do not count), 1 otherwise, 2 on bad usage.
#
# QUICK=1 runs no GPU work: it checks the wheel folder against the list (when there is
# one), the environment step, and each GPU step's entry (its --help, which imports what
# the step needs), then writes the JSON and the table with those steps "skipped: no GPU".
# LEASE_DEVICE=cpu runs every step for real on the CPU at toy sizes (the Triton kernels in
# Triton's interpreter, TorchTitan's debug model, gloo), in minutes: a check of the whole
# pipeline, figures and summary included, without a GPU (scripts/torch_check.sh runs it on
# the GPU machine's torch).
set -uo pipefail

if [[ $# -gt 1 || "${1:-}" == -* ]]; then
  echo "usage: [QUICK=1] $0 OUT_DIR (or set OUT)" >&2
  exit 2
fi
out="${1:-${OUT:-}}"
if [[ -z "$out" ]]; then
  echo "usage: [QUICK=1] $0 OUT_DIR (or set OUT)" >&2
  exit 2
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
  PY=python3
  [[ -x "$ROOT/.venv/bin/python" ]] && PY="$ROOT/.venv/bin/python" # scripts/setup.sh's
fi
WHEELS="${GPU_WHEELS:-$ROOT/.gpu_wheels}"
BUDGET="${LEASE_BUDGET_S:-420}"
RESERVE=15 # seconds kept for the summary
quick="${QUICK:-}"
work="$(mktemp -d "${TMPDIR:-/tmp}/gpu_lease.XXXXXX")"
site="$work/site"
mkdir -p "$work/steps" "$work/logs"
log="$out/gpu_lease.log"
: >"$log"
rm -f "$out/gpu_lease.json" "$out/gpu_lease.md"
export PYTHONUNBUFFERED=1 PYTHONPATH="$ROOT:$site${PYTHONPATH:+:$PYTHONPATH}"
# No network there: datasets and the hub read local files only, without trying the hub.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1

say() { echo "[gpu_lease] $*" | tee -a "$log"; }

# record NAME STATUS RC SECONDS LIMIT REASON
record() {
  printf 'status=%s\nrc=%s\nseconds=%s\nlimit=%s\nreason=%s\n' "$2" "$3" "$4" "$5" "$6" \
    >"$work/steps/$1.status"
  say "-- $1: $2${6:+ ($6)}${4:+ in ${4}s}"
  summarize "$PY" >/dev/null 2>&1 # the JSON and the table as they stand now
}

summarize() {
  "$1" benchmarks/gpu_lease.py summary --work "$work" --out "$out" --elapsed "$SECONDS" \
    --budget "$BUDGET" ${quick:+--quick}
}

# step NAME LIMIT COMMAND...: COMMAND under `timeout`, within what is left of the budget.
step() {
  local name="$1" limit="$2"
  shift 2
  local avail=$((BUDGET - RESERVE - SECONDS))
  if [[ "$avail" -lt 20 ]]; then
    record "$name" skipped "" "" "$limit" "no time left of the ${BUDGET}s budget"
    return 1
  fi
  [[ "$limit" -le "$avail" ]] || limit="$avail"
  say "== $name (at most ${limit}s): $*"
  local started=$SECONDS rc status
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$work/logs/$name.log"
  rc="${PIPESTATUS[0]}"
  cat "$work/logs/$name.log" >>"$log"
  case "$rc" in
    0) status=passed ;;
    124 | 137) status=timeout ;;
    *) status=failed ;;
  esac
  record "$name" "$status" "$rc" "$((SECONDS - started))" "$limit" ""
  [[ "$status" == passed ]]
}

# skip NAME REASON
skip() { record "$1" skipped "" "" "" "$2"; }

say "GPU lease check: $(date -u '+%F %T UTC'), $ROOT at $(git rev-parse --short HEAD 2>/dev/null || echo '?'), PYTHON=$PY, budget ${BUDGET}s${quick:+, QUICK}"
gpu_steps=(engine syncs ns titan_DMuon titan_AdamW titan_DMuon_compiled titan_AdamW_compiled
  titan_DMuon_float8)
declare -A entry=( # each step's command of benchmarks/gpu_lease.py, the one entry
  [engine]=engine [syncs]=syncs [ns]=ns [titan_DMuon]=titan [titan_AdamW]=titan
  [titan_DMuon_compiled]=titan [titan_AdamW_compiled]=titan [titan_DMuon_float8]=titan
)
float8=(--model.converters quantize.linear.float8)

if [[ -n "$quick" ]]; then
  if [[ -d "$WHEELS" ]]; then
    step wheels 30 "$PY" benchmarks/gpu_lease.py wheels --dir "$WHEELS"
  else
    skip wheels "no $WHEELS here (scripts/gpu_wheels.sh makes it)"
  fi
  skip assets "QUICK"
  step env 60 "$PY" benchmarks/gpu_lease.py env --out "$work/env.json" --site "$site"
  declare -A helped=()
  for name in "${gpu_steps[@]}"; do
    # One --help per entry; the titan steps share theirs.
    if [[ -n "${helped[${entry[$name]}]:-}" ]] \
      || step "$name" 60 "$PY" benchmarks/gpu_lease.py "${entry[$name]}" --help; then
      helped[${entry[$name]}]=1
      skip "$name" "no GPU (QUICK=1: its entry's --help ran)"
    fi
  done
else
  if [[ "${LEASE_DEVICE:-cuda}" == cpu && ! -d "$WHEELS" ]]; then
    skip wheels "no $WHEELS here: PYTHON's own packages"
  else
    step wheels 90 "$PY" benchmarks/gpu_lease.py wheels --dir "$WHEELS" --install "$site"
  fi
  if [[ -f assets/tokenizer/tokenizer.json && -f assets/corpus/stdlib_docstrings.jsonl ]]; then
    skip assets "already built"
  else
    step assets 90 "$PY" torchtitan_dmuon/titan/assets.py --out "$ROOT/assets"
  fi
  step env 90 "$PY" benchmarks/gpu_lease.py env --out "$work/env.json" --site "$site"
  # titan NAME LIMIT OPTIMIZER COMPILE OVERRIDES...: one TorchTitan run, COMPILE
  # "enable" or "no-enable" (torch.compile of the model and the loss).
  titan() {
    local name="$1" limit="$2" optimizer="$3" compile="$4"
    shift 4
    step "$name" "$limit" "$PY" benchmarks/gpu_lease.py titan --optimizer "$optimizer" \
      --dump "$work/$name" "${toy[@]}" -- "--compile.$compile" "$@"
  }
  if [[ "${LEASE_DEVICE:-cuda}" == cpu ]]; then
    toy=(--flavor debugmodel --config train_configs/debug_cpu.toml --seq-len 128 --batch 2
      --steps "${TITAN_STEPS:-3}")
    step engine 240 "$PY" benchmarks/gpu_lease.py engine --device cpu \
      --out "$work/engine.json"
    step syncs 90 "$PY" benchmarks/gpu_lease.py syncs --device cpu --out "$work/syncs.json"
    step ns 120 env TRITON_INTERPRET=1 "$PY" benchmarks/gpu_lease.py ns --device cpu \
      --shapes 64x128 128x64 --reps 1 --out "$work/ns"
    titan titan_DMuon 150 DMuon no-enable
    titan titan_AdamW 150 AdamW no-enable
    titan titan_DMuon_compiled 240 DMuon enable
    titan titan_AdamW_compiled 240 AdamW enable
    titan titan_DMuon_float8 150 DMuon no-enable "${float8[@]}" --quantize.linear.float8.emulate
  elif ! "$PY" -c 'import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))["cuda"] else 1)' \
      "$work/env.json" 2>/dev/null; then
    for name in "${gpu_steps[@]}"; do skip "$name" "no GPU (torch sees no CUDA device)"; done
  else
    toy=(--steps "${TITAN_STEPS:-20}")
    step engine 120 "$PY" benchmarks/gpu_lease.py engine --timeout 60 \
      --out "$work/engine.json"
    step syncs 45 "$PY" benchmarks/gpu_lease.py syncs --out "$work/syncs.json"
    step ns 75 "$PY" benchmarks/gpu_lease.py ns --shapes 4096x4096 4096x14336 --reps 5 \
      --out "$work/ns"
    titan titan_DMuon 75 DMuon no-enable
    titan titan_AdamW 75 AdamW no-enable
    titan titan_DMuon_compiled 100 DMuon enable
    titan titan_AdamW_compiled 100 AdamW enable
    toy=(--steps "${TITAN_FLOAT8_STEPS:-10}")
    titan titan_DMuon_float8 90 DMuon enable "${float8[@]}"
  fi
fi

say "== summary after ${SECONDS}s"
summarize "$PY" 2>&1 | tee -a "$log"
rc="${PIPESTATUS[0]}"
if [[ ! -f "$out/gpu_lease.json" ]] && command -v python3 >/dev/null; then
  summarize python3 2>&1 | tee -a "$log"
  rc="${PIPESTATUS[0]}"
fi
rm -rf "$work"
say "wrote $out/gpu_lease.json, gpu_lease.md and gpu_lease.log (exit $rc)"
exit "$rc"
