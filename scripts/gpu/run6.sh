#!/usr/bin/env bash
# GPU run 6 (results/gpu/run6/): trainer fast paths test (with replay), Triton MSA fp32 tests, the MSA kernel
# config sweep at 32K, and the M3-width 2-layer trainer step (8 x 16K tokens) with the quantized and the bf16 base.
# Ran as scripts/gpu_run6.sh before the move. Through the device tool from the repo root
# (carry .whl): bash scripts/gpu/run6.sh
source "$(dirname "$0")/lib.sh"
M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run trainer_tests 90 $P tests/rl/test_trainer_gpu.py -s
run msa_triton_tests 90 $P tests/rl/test_msa_triton.py -k "gpu and fp32 and not 32k"
run bench_msa_sweep 120 python3 scripts/bench_msa.py --impl triton --lengths 32768 --repeats 3 --sweep --no-sdpa \
    --out "$OUT/bench_msa_sweep.json"
for base in quantized bf16; do  # one GPU: the base replicated (FSDP2 at world size 1 would hold it twice)
  run "slice_$base" 110 torchrun --nproc-per-node 1 scripts/train_step_m3.py --layers 2 --seq-len 16384 \
      --seqs-per-rank 8 --steps 2 --base "$base" --shard-base 0
done
grep -h -E "passed|failed|Error|step_s_median|peak_allocated_gb_max|tokens_per_s\"" "$OUT"/*.log | grep -v DEBUG | tail -n 20
cat "$OUT/summary.log"
