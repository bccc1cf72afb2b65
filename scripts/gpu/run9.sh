#!/usr/bin/env bash
# GPU run 9 (results/gpu/run9/), one H200: the Triton MSA tests and the trainer fast-paths test with 2-token groups
# (the new default), the MSA benchmark with it (4K-64K vs dense SDPA, tile sweep), and the M3-width 2-layer trainer
# step at 8 x 16K tokens (out of memory in run 6 without MoE token chunks), quantized vs bf16 base.
# Through the device tool from the repo root (carry .whl): bash scripts/gpu/run9.sh
source "$(dirname "$0")/lib.sh"
M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run tests 130 $P tests/rl/test_msa_triton.py tests/rl/test_trainer_gpu.py
run bench_msa 130 python3 scripts/bench_msa.py --lengths 4096,16384,32768,65536 --repeats 5 --sweep \
    --out "$OUT/bench_msa.json"
for base in quantized bf16; do
  run "slice8_$base" 100 torchrun --nproc-per-node 1 scripts/train_step_m3.py --layers 2 --seq-len 16384 \
      --seqs-per-rank 8 --steps 2 --base "$base" --shard-base 0 --moe-chunk-tokens 16384 --out "$OUT/slice8_$base.json"
done
grep -h -E "passed|failed|Error" "$OUT"/*.log | grep -v DEBUG | tail -n 12
pack_logs
cat "$OUT/summary.log"
