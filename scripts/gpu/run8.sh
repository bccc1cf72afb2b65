#!/usr/bin/env bash
# GPU run 8 (results/gpu/run8/), one H200: every GPU test (NVFP4/MXFP8 kernels incl. the dgrad tile candidates,
# Triton MSA attention + index scores, the trainer's fast paths incl. MoE token chunks), the MSA benchmark
# (4K-64K vs dense SDPA, tile sweep at each length), the expert GEMM at many tokens with tile variants, and the
# M3-width 2-layer trainer step (4 x 16K tokens) with MoE token chunks, quantized vs bf16 base.
# Through the device tool from the repo root (carry .whl): bash scripts/gpu/run8.sh
source "$(dirname "$0")/lib.sh"
M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run tests 180 $P tests/quant/test_kernels_gpu.py tests/rl/test_msa_triton.py \
    tests/rl/test_trainer_gpu.py
run bench_msa 130 python3 scripts/bench_msa.py --lengths 4096,16384,32768,65536 --repeats 5 --sweep \
    --out "$OUT/bench_msa.json"
run expert_large 60 python3 scripts/bench_expert_gemm.py --tokens 4096,32768 --variants --rep-ms 40 \
    --out "$OUT/expert_large.json"
for base in quantized bf16; do
  run "slice_$base" 90 torchrun --nproc-per-node 1 scripts/train_step_m3.py --layers 2 --seq-len 16384 \
      --seqs-per-rank 4 --steps 2 --base "$base" --shard-base 0 --moe-chunk-tokens 16384 --out "$OUT/slice_$base.json"
done
grep -h -E "passed|failed|Error" "$OUT"/*.log | grep -v DEBUG | tail -n 12
pack_logs
cat "$OUT/summary.log"
