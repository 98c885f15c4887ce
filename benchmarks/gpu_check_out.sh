# Sourced by the gpu_check_*.sh scripts, with their arguments: the output folder from $1
# or $OUT, made and kept absolute as $out, then the working directory set to the
# repository root (the scripts name every path from there).
out="${1:-${OUT:-}}"
if [ -z "$out" ]; then
    echo "usage: $0 OUT_DIR (or set OUT)" >&2
    exit 2
fi
mkdir -p "$out"
out="$(cd "$out" && pwd)"
cd "$(dirname "$0")/.."
