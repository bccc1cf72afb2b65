#!/usr/bin/env bash
# The GPU runs behind results/gpu/*, in one device call (the H200 has no vLLM: everything here imports only
# torch/transformers/quant/rl). From the repo root, through the device tool (carry .whl):
#   bash scripts/gpu/suite.sh        -> $OUT/summary.log, *.log, *.xml, *.json; copied into results/gpu/
# (runs 1-2, then as scripts/gpu_suite.sh). transformers 5.19 (minimax_m3_vl) travels as a wheel in .whl.
OUT="${OUT:-results/gpu}"
source "$(dirname "$0")/lib.sh"
{ nvidia-smi -L; python3 -c "import torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"; } > "$OUT/env.log" 2>&1
run quant_tests 90 $P tests/quant/test_cuda_matches_cpu.py --junitxml="$OUT/quant_tests.xml"
run msa_tests 150 $P tests/rl/test_msa.py --junitxml="$OUT/msa_tests.xml"
run kernel_tests 90 $P tests/quant/test_kernels_gpu.py --junitxml="$OUT/kernel_tests.xml"
run trainer_tests 150 $P tests/rl/test_trainer_gpu.py --junitxml="$OUT/trainer_tests.xml"
run bench_msa 120 python3 scripts/bench_msa.py --lengths 4096,16384,32768 --repeats 3 --out "$OUT/bench_msa.json"
run trainer_memory 150 python3 scripts/bench_trainer_memory.py --device cuda --repeats 1 --out "$OUT/trainer_memory_gpu.json"
tail -n 2 "$OUT"/*.log
