#!/usr/bin/env bash
# GPU run 5 (results/gpu/run5_x2/), two H200s (device kind nvidia-h200-x2), for the full-size trainer issue:
#  0) the NVFP4/MXFP8 kernel tests with the new default tile configs (BN=64 at few tokens, BM=256 at many);
#  a) the M3-width 2-layer step of run 4 on 2 ranks (same tokens per rank: weak scaling 1 -> 2 GPUs, base sharded);
#  b) all 60 layers at full width with 16 experts per layer (the code path at full depth: 3 dense + 57 MoE/MSA
#     layers, vocab 200064; 128 experts would need >= 4 GPUs).
# Through the device tool from the repo root (carry .whl): bash scripts/gpu_run5_x2.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD"
OUT="${OUT:-results/gpu/run5_x2}"; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
run() { local name=$1 limit=$2; shift 2; local t=$(date +%s); timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; echo "$name rc=$? $(( $(date +%s) - t ))s" | tee -a "$OUT/summary.log"; }
nvidia-smi -L > "$OUT/env.log" 2>&1
run kernel_tests 60 python3 -m pytest -m gpu -q -p no:cacheprovider -p no:logging tests/quant/test_kernels_gpu.py
run slice2_x2 180 torchrun --nproc-per-node 2 scripts/train_step_m3.py --layers 2 --seq-len 16384 --seqs-per-rank 8 \
    --steps 1 --base quantized --out "$OUT/slice2_x2.json"
run depth60_e16_x2 300 torchrun --nproc-per-node 2 scripts/train_step_m3.py --seq-len 16384 --seqs-per-rank 1 \
    --steps 2 --base quantized --override '{"num_local_experts": 16}' --out "$OUT/depth60_e16_x2.json"
grep -h -E "Error|error|step_s_median|peak_allocated_gb_max|tokens_per_s" "$OUT"/*.log | tail -n 20
cat "$OUT/summary.log"
