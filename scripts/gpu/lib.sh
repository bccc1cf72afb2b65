# Sourced by scripts/gpu/run.sh (through the device tool, from the repo root, carry .whl).
# Sets up the H200's Python (transformers 5.19 from .whl; the machine has torch/triton but no vLLM and no network),
# $OUT (the device tool's output folder, else results/gpu/<name>), $P (pytest on -m gpu tests) and
# `run NAME LIMIT CMD...`: CMD's output to $OUT/NAME.log, its exit code and seconds to $OUT/summary.log.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD" M3RL_TINY_MODEL_CACHE=/tmp/m3cache
OUT="${OUT:-results/gpu/$(basename "$0" .sh)}"; mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)  # steps may cd (base/)
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
# TRITON=V: Triton V (a carried .whl/triton-V-cp312-sm90.tar.xz, made by scripts/gpu/triton_bundle.sh) instead of the
# machine's 3.6.0, first on PYTHONPATH; unpacked once per machine
if [ -n "${TRITON:-}" ]; then
  site=/tmp/triton-$TRITON
  if [ ! -d "$site/triton" ]; then
    bundle=$(ls .whl/triton-"$TRITON"-*-sm90.tar.xz 2>/dev/null | head -n 1)
    [ -n "$bundle" ] || { echo "TRITON=$TRITON: no .whl/triton-$TRITON-*-sm90.tar.xz carried" >&2; exit 2; }
    mkdir -p "$site" && tar -C "$site" -xJf "$bundle"
  fi
  export PYTHONPATH="$site:$PYTHONPATH"
  python3 -c "import triton, sys; assert triton.__version__ == sys.argv[1], triton.__file__" "$TRITON" || exit 2
fi
run() { local name=$1 limit=$2; shift 2; local t=$(date +%s); timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a "$OUT/summary.log"; }
P="python3 -m pytest -m gpu -q -p no:cacheprovider -p no:logging"
# The device tool returns at most 8 files: keep summary.log and the JSON results, pack the logs into one archive.
pack_logs() { (cd "$OUT" && tar czf logs.tgz $(ls *.log | grep -v '^summary.log$') && rm -f $(ls *.log | grep -v '^summary.log$')); }
