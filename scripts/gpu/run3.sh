#!/usr/bin/env bash
# GPU run 3 (results/gpu/run3/): trainer fast paths test, kernel config variants, expert tile variants at few tokens,
# and the M3-width 2-layer trainer step (scripts/train_step_m3.py) with the quantized and the bf16 base.
# Ran as scripts/gpu_run3.sh before the move. Through the device tool from the repo root
# (carry .whl): bash scripts/gpu/run3.sh
source "$(dirname "$0")/lib.sh"
M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run trainer_tests 150 $P tests/rl/test_trainer_gpu.py -s
run kernel_variants 60 $P tests/quant/test_kernels_gpu.py -k variants
run expert_small 60 python3 scripts/bench_expert_gemm.py --tokens 64,512 --variants --rep-ms 40 --out "$OUT/expert_small.json"
for base in quantized bf16; do
  run "slice_$base" 150 torchrun --nproc-per-node 1 scripts/train_step_m3.py --layers 2 --seq-len 16384 \
      --seqs-per-rank 8 --steps 2 --base "$base"
done
grep -h -E "passed|failed|Error|error" "$OUT"/*.log | grep -v DEBUG | tail -n 20
cat "$OUT/summary.log"
