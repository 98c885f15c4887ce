#!/usr/bin/env bash
# Downloads the wheels benchmarks/gpu_lease.sh installs on the GPU check machine (which has
# no network): every package of scripts/gpu_wheels.txt, pinned, for CPython 3.12 on
# manylinux x86_64, without dependencies (the list names each one the machine lacks).
#
#   scripts/gpu_wheels.sh [DIR]        # default: .gpu_wheels/ (git-ignored)
#
# Run it on a machine that reaches PyPI, then carry DIR to the GPU machine (the device
# tool's `carry: [".gpu_wheels"]`). Wheels of other versions or packages are removed from
# DIR, so that it holds exactly one wheel per package. Prints each wheel's size and the
# total; fails when the folder is over GPU_WHEELS_MAX_MIB (default 48: the working tree
# and the carried folders travel in 64 MiB). PYTHON picks the pip (default python3).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.gpu_wheels}"
LIST="$ROOT/scripts/gpu_wheels.txt"
MAX_MIB="${GPU_WHEELS_MAX_MIB:-48}"
PY="${PYTHON:-python3}"

mapfile -t pins < <(sed -e 's/#.*//' -e 's/[[:space:]]//g' "$LIST" | grep -v '^$')
[[ ${#pins[@]} -gt 0 ]] || { echo "gpu_wheels.sh: no package in $LIST" >&2; exit 1; }
mkdir -p "$DIR"

# pip matches each manylinux tag exactly: name the ones these packages ship.
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 \
    manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
"$PY" -m pip download --disable-pip-version-check -q --no-deps --only-binary=:all: \
  --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none \
  "${platforms[@]}" -d "$DIR" "${pins[@]}"

# Exactly the pinned wheels: the others (an older pin's, say) go.
normalize() { echo "$1" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/-/g'; }
declare -A wanted=()
for pin in "${pins[@]}"; do
  wanted["$(normalize "${pin%%==*}")==${pin#*==}"]=1
done
found=0
for wheel in "$DIR"/*.whl; do
  base="$(basename "$wheel")"
  IFS=- read -r name version _ <<<"$base"
  key="$(normalize "$name")==$version"
  if [[ -n "${wanted[$key]:-}" ]]; then
    unset "wanted[$key]"
    found=$((found + 1))
  else
    echo "gpu_wheels.sh: removing $base (not in $(basename "$LIST"))"
    rm -f "$wheel"
  fi
done
if [[ ${#wanted[@]} -gt 0 ]]; then
  echo "gpu_wheels.sh: no wheel in $DIR for: ${!wanted[*]}" >&2
  exit 1
fi

ls -l "$DIR"/*.whl | awk '{printf "%8.2f MiB  %s\n", $5 / 1048576, $NF}'
total_kib="$(du -sk "$DIR" | cut -f1)"
total_mib="$(awk -v k="$total_kib" 'BEGIN { printf "%.2f", k / 1024 }')"
echo "gpu_wheels.sh: $found wheels, $total_mib MiB in $DIR (limit $MAX_MIB MiB)"
if [[ "$total_kib" -gt $((MAX_MIB * 1024)) ]]; then
  echo "gpu_wheels.sh: $DIR is over $MAX_MIB MiB: it would not travel with the working tree" >&2
  exit 1
fi
