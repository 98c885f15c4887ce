#!/usr/bin/env bash
# Idempotent fresh-machine setup shared by run_train.sh and run_tests.sh.
#
#   scripts/setup.sh         what training needs: the project editable and its dependencies
#   scripts/setup.sh --hf    also transformers, for TorchTitan's HF backend (run_train.sh
#                            asks for it when the config trains transformers_modeling_backend)
#   scripts/setup.sh --dev   also the test, benchmark, HF-backend (transformers), VLM
#                            (einops, Pillow) and peer extras (run_tests.sh's)
#   TORCHTITAN_VERSION=0.3.0 scripts/setup.sh [--dev]
#                            the same beside TorchTitan 0.3.0 (its adapter,
#                            torchtitan_dmuon.titan03) in its own venv,
#                            .venvs/torchtitan-0.3.0, with torch 2.14.1 and
#                            scripts/constraints-0.3.0.txt (--dev: the test extra)
#
# Creates .venv if absent and installs the project editable.
# torch is installed first and then frozen with a constraint, so that no later
# requirement can swap it: on a machine without an NVIDIA GPU that is the CPU build
# of torch 2.13.0 (plus triton 3.9.0, which torchtitan imports); on a CUDA machine
# the CUDA torch already present (TORCH_SUPPORTED: 2.11 to 2.14 beside TorchTitan 0.2.2) is kept and everything
# is installed around it, or, where there is none, torch is installed from
# DMUON_TORCH_INDEX_URL (default: the package index; e.g.
# https://download.pytorch.org/whl/cu128 for CUDA 12.8 wheels).
# A venv holding CPU torch on a node with NVIDIA GPUs stops every launch with the fix
# (DMUON_ALLOW_CPU=1: train on the CPUs anyway).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/torchtitan_env.sh" # TORCHTITAN_VERSION, VENV
case "$TORCHTITAN_VERSION" in
  0.2.2)
    CONSTRAINTS="$ROOT/scripts/constraints.txt"
    TORCH_CPU_VERSION="2.13.0"
    # The CPU wheel requires no triton, which torchtitan imports.
    TRITON_CPU_VERSION="3.9.0"
    # The torch releases TorchTitan 0.2.2's trainer is tested with, from 2.11, what GPU
    # images ship (docs/troubleshooting.md#versions: why; the engine alone takes 2.15
    # too). CPU machines get TORCH_CPU_VERSION.
    TORCH_SUPPORTED=">=2.11,<2.15"
    TORCH_RELEASES="2.11 2.12 2.13 2.14"
    DEV_EXTRAS="[test,bench,hf,vlm,peer-muon-fsdp2,peer-dtensor-muon]"
    ;;
  0.3.0)
    CONSTRAINTS="$ROOT/scripts/constraints-0.3.0.txt"
    # The CUDA build on disk (it runs on the CPU; it brings its triton): 0.3.0's default
    # backend needs FSDP2's DataParallelMeshDims (torch 2.14).
    TORCH_CPU_VERSION="2.14.1"
    TRITON_CPU_VERSION=""
    TORCH_SUPPORTED=">=2.14,<2.15"
    TORCH_RELEASES="2.14"
    DEV_EXTRAS="[test]"
    ;;
esac
PY="$VENV/bin/python"
STAMP="$VENV/.dmuon-setup-stamp"

log() { echo "[setup] $*" >&2; }

case "${1:-}" in
  "") kind=train; extras="" ;;
  --hf) kind=hf; extras="[hf]" ;;
  --dev) kind=dev; extras="$DEV_EXTRAS" ;;
  *) echo "[setup] unknown argument '$1' (expected nothing, --hf or --dev)" >&2; exit 2 ;;
esac

has_gpu=0
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L 2>/dev/null | grep -q '^GPU '; then has_gpu=1; fi
# Checked at every launch (a directory listing, no import): a venv set up on a node without
# GPUs (a login node) holds CPU torch, with which a GPU node would train on its CPUs.
if [[ "$has_gpu" == 1 && "${DMUON_ALLOW_CPU:-}" != 1 ]] \
    && compgen -G "$VENV/lib/python3*/site-packages/torch-*+cpu.dist-info" >/dev/null; then
  cpu_torch="$(basename "$(compgen -G "$VENV/lib/python3*/site-packages/torch-*+cpu.dist-info" | head -1)" .dist-info)"
  echo "[setup] this node has NVIDIA GPUs (nvidia-smi -L) but $VENV holds the CPU build" \
    "${cpu_torch#torch-} of torch (set up on a node without GPUs). Set it up again here:" \
    "rm -rf $VENV && ./scripts/setup.sh (DMUON_TORCH_INDEX_URL picks the CUDA wheel index," \
    "e.g. https://download.pytorch.org/whl/cu128; or DMUON_VENV=<another folder>), or" \
    "set DMUON_ALLOW_CPU=1 to train on the CPUs" >&2
  exit 1
fi

# Re-run only when the project's dependency list changed since the last setup (or the
# extras are wanted and were not installed). Contents only (not paths), so that
# checkouts in other folders share one stamp.
want_stamp="$( (cat "$ROOT/pyproject.toml" "$ROOT/scripts/setup.sh" "$CONSTRAINTS"; echo "$TORCHTITAN_VERSION") \
  | sha256sum | cut -d' ' -f1)"
have_stamp="$(cat "$STAMP" 2>/dev/null || true)"
ASSETS="$ROOT/assets"
# assets/ is complete with its tokenizer and the held-out split; one built before the
# split existed (no heldout/) is rebuilt, so that training never sees the held-out documents.
assets_ready() { [[ -f "$ASSETS/tokenizer/tokenizer.json" && -f "$ASSETS/heldout/stdlib_docstrings.jsonl" ]]; }
# The VLM's generated image-caption-action shard and image tokenizer (titan/vlm_assets.py),
# where Pillow is installed (the vlm extra).
vlm_assets_ready() { [[ -f "$ASSETS/vlm/data/shard-00000.tar" ]] || ! "$PY" -c "import PIL" 2>/dev/null; }
# A setup of a larger kind serves a smaller one: train < hf < dev.
declare -A serves=([train]="train" [hf]="train hf" [dev]="train hf dev")
have_kind="${have_stamp#* }"
if [[ -x "$PY" && "${have_stamp%% *}" == "$want_stamp" && " ${serves[${have_kind:-none}]:-} " == *" $kind "* ]] \
    && assets_ready && vlm_assets_ready; then
  exit 0
fi

if [[ ! -x "$PY" ]]; then
  # A venv that may see the system site-packages is the only way to keep a CUDA torch
  # that a GPU image ships; on CPU machines the venv is isolated.
  if command -v nvidia-smi >/dev/null 2>&1 && python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
    log "creating $VENV with access to the system CUDA torch"
    python3 -m venv --system-site-packages "$VENV"
  else
    log "creating $VENV"
    python3 -m venv "$VENV"
  fi
fi
PIP=("$PY" -m pip --disable-pip-version-check -q)

installed_torch="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"

if [[ "$has_gpu" == 1 && -n "$installed_torch" && "$installed_torch" != *+cpu* ]]; then
  log "keeping CUDA torch $installed_torch"
elif [[ "$has_gpu" == 1 ]]; then
  index=()
  [[ -z "${DMUON_TORCH_INDEX_URL:-}" ]] || index=(--index-url "$DMUON_TORCH_INDEX_URL")
  log "NVIDIA GPU found and no CUDA torch present: installing torch$TORCH_SUPPORTED from" \
    "${DMUON_TORCH_INDEX_URL:-the default index}"
  "${PIP[@]}" install ${index[@]+"${index[@]}"} "torch$TORCH_SUPPORTED"
elif [[ "$installed_torch" != "$TORCH_CPU_VERSION"* ]]; then
  log "installing CPU torch $TORCH_CPU_VERSION"
  "${PIP[@]}" install "torch==$TORCH_CPU_VERSION"
fi
# The CPU torch wheel does not require triton and nothing else here does: it installs
# (~1 GB unpacked) beside the project's dependencies, not before them.
triton_pid=""
if [[ "$has_gpu" == 0 && -n "$TRITON_CPU_VERSION" ]]; then
  "${PIP[@]}" install "triton==$TRITON_CPU_VERSION" &
  triton_pid=$!
fi

torch_now="$("$PY" -c 'import torch; print(torch.__version__)')"
if [[ " $TORCH_RELEASES " != *" $(cut -d. -f1,2 <<<"$torch_now") "* ]]; then
  echo "[setup] torch $torch_now is not supported beside TorchTitan $TORCHTITAN_VERSION" \
    "(need torch$TORCH_SUPPORTED: $TORCH_RELEASES)" >&2
  exit 1
fi
constraints="$(mktemp)"
trap 'rm -f "$constraints"' EXIT
# Its public version: a local label (+cu130) is above the cap pip may have (torch<=2.14.1).
echo "torch==${torch_now%%+*}" >"$constraints"
# The tested versions beside this TorchTitan (but the torch found, kept).
grep -v '^torch==' "$CONSTRAINTS" >>"$constraints"

log "installing torchtitan-dmuon$extras (editable) around torch $torch_now"
"${PIP[@]}" install -c "$constraints" -e "$ROOT$extras"
if [[ -n "$triton_pid" ]] && ! wait "$triton_pid"; then
  echo "[setup] installing triton $TRITON_CPU_VERSION failed (see above)" >&2
  exit 1
fi

# Offline training assets (a text corpus, its held-out split and the tokenizer), built
# locally, never downloaded. Run as a file: it needs only the standard library and
# tokenizers, not the package's imports (torch, TorchTitan: seconds).
if ! assets_ready; then
  log "building the training corpus, its held-out split and the tokenizer in $ASSETS"
  "$PY" "$ROOT/torchtitan_dmuon/titan/assets.py" --out "$ASSETS"
fi
if ! vlm_assets_ready; then
  log "generating the VLM image-caption-action shard and image tokenizer in $ASSETS/vlm"
  "$PY" "$ROOT/torchtitan_dmuon/titan/vlm_assets.py" --out "$ASSETS/vlm" --assets "$ASSETS"
fi

echo "$want_stamp $kind" >"$STAMP"
log "done"
