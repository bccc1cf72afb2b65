#!/usr/bin/env bash
# GPU run 4 (results/gpu/run4/): trainer fast paths test (with replay), Triton MSA kernels (tests + benchmark),
# and the M3-width 2-layer trainer step (scripts/train_step_m3.py) with the quantized and the bf16 base.
# Through the device tool from the repo root (carry .whl): bash scripts/gpu_run4.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD" M3RL_TINY_MODEL_CACHE=/tmp/m3cache
OUT="${OUT:-results/gpu/run4}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { local name=$1 limit=$2; shift 2; local t=$(date +%s); timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a "$OUT/summary.log"; }
P="python3 -m pytest -m gpu -q -p no:cacheprovider -p no:logging"
M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run trainer_tests 120 $P tests/rl/test_trainer_gpu.py -s
run msa_triton_tests 110 $P tests/rl/test_msa_triton.py -k "gpu and not (32k and fp32)"
run bench_msa 120 python3 scripts/bench_msa.py --impl triton --lengths 4096,16384,32768,65536 --repeats 5 --out "$OUT/bench_msa.json"
for base in quantized bf16; do
  run "slice_$base" 110 torchrun --nproc-per-node 1 scripts/train_step_m3.py --layers 2 --seq-len 16384 \
      --seqs-per-rank 8 --steps 2 --base "$base"
done
grep -h -E "passed|failed|Error|error" "$OUT"/*.log | grep -v DEBUG | tail -n 20
cat "$OUT/summary.log"
