#!/usr/bin/env bash
# GPU run 10 (results/gpu/run10/), one H200: the Triton MSA tests and the trainer fast-paths test with 1-token
# groups (the new default after run 9's sweep), and the MSA benchmark at 32K tokens with it.
# Through the device tool from the repo root (carry .whl): bash scripts/gpu/run10.sh
source "$(dirname "$0")/lib.sh"
M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run tests 110 $P tests/rl/test_msa_triton.py tests/rl/test_trainer_gpu.py
run bench_msa 40 python3 scripts/bench_msa.py --lengths 32768 --repeats 5 --no-sdpa --out "$OUT/bench_msa.json"
grep -h -E "passed|failed|Error" "$OUT"/*.log | grep -v DEBUG | tail -n 8
pack_logs
cat "$OUT/summary.log"
