#!/usr/bin/env bash
# GPU run 7 (results/gpu/run7_x2/), two H200s (device kind nvidia-h200-x2), in two phases:
#  1) in parallel: GPU 0 runs the kernel tests (new default tiles: BN=64 at few tokens, BM=256 at many), the Triton
#     MSA bf16 tests and the trainer fast-paths test; GPU 1 runs the M3-width 2-layer trainer step (4 x 16K
#     tokens) with the quantized and then the bf16 base (base replicated: world size 1);
#  2) on both GPUs: the same 2-layer step on 2 ranks (4 x 16K tokens per rank, base sharded: weak scaling 1 -> 2),
#     then all 60 layers at full width with 16 experts per layer (the code path at full depth; 128 experts need
#     >= 4 GPUs).
# Ran as scripts/gpu_run7_x2.sh before the move. Through the device tool from the repo root
# (carry .whl): bash scripts/gpu/run7_x2.sh
source "$(dirname "$0")/lib.sh"
STEP="scripts/train_step_m3.py --layers 2 --seq-len 16384 --seqs-per-rank 4 --steps 2"
( export CUDA_VISIBLE_DEVICES=0
  run kernel_tests 60 $P tests/quant/test_kernels_gpu.py tests/rl/test_msa_triton.py
  M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run trainer_tests 90 $P tests/rl/test_trainer_gpu.py ) &
( export CUDA_VISIBLE_DEVICES=1
  run slice_quantized 110 torchrun --nproc-per-node 1 --master-port 29611 $STEP --base quantized --shard-base 0
  run slice_bf16 110 torchrun --nproc-per-node 1 --master-port 29612 $STEP --base bf16 --shard-base 0 ) &
wait
run slice2_x2 120 torchrun --nproc-per-node 2 $STEP --base quantized --shard-base 1
run depth60_e16_x2 210 torchrun --nproc-per-node 2 scripts/train_step_m3.py --seq-len 16384 --seqs-per-rank 1 \
    --steps 2 --base quantized --override '{"num_local_experts": 16}'
grep -h -E "passed|failed|Error|\"step_s_median|\"peak_allocated_gb_max|\"tokens_per_s\"" "$OUT"/*.log | grep -v DEBUG | tail -n 24
cat "$OUT/summary.log"
