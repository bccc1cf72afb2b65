#!/usr/bin/env bash
# GPU run 4 (results/gpu/run4/): trainer fast paths test (with replay), Triton MSA kernels (tests + benchmark),
# and the M3-width 2-layer trainer step (scripts/train_step_m3.py) with the quantized and the bf16 base.
# Ran as scripts/gpu_run4.sh before the move. Through the device tool from the repo root
# (carry .whl): bash scripts/gpu/run4.sh
source "$(dirname "$0")/lib.sh"
M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run trainer_tests 120 $P tests/rl/test_trainer_gpu.py -s
run msa_triton_tests 110 $P tests/rl/test_msa_triton.py -k "gpu and not (32k and fp32)"
run bench_msa 120 python3 scripts/bench_msa.py --impl triton --lengths 4096,16384,32768,65536 --repeats 5 --out "$OUT/bench_msa.json"
for base in quantized bf16; do
  run "slice_$base" 110 torchrun --nproc-per-node 1 scripts/train_step_m3.py --layers 2 --seq-len 16384 \
      --seqs-per-rank 8 --steps 2 --base "$base"
done
grep -h -E "passed|failed|Error|error" "$OUT"/*.log | grep -v DEBUG | tail -n 20
cat "$OUT/summary.log"
