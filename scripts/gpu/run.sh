#!/usr/bin/env bash
# A parametrized GPU run through the device tool, from the repo root (or a copy of it) with .whl carried:
#   bash scripts/gpu/run.sh STEP...        (results land in $OUT, else results/gpu/run/)
# STEPs, each logged to $OUT/<name>.log with its exit code and seconds in $OUT/summary.log:
#   tests                 pytest -m gpu: the quant kernels, CUDA == CPU quant forms (tests/quant/test_kernels_gpu.py,
#                         test_cuda_matches_cpu.py) and the trainer fast-paths test (tests/rl/model/test_trainer_gpu.py)
#   kernel_tests          pytest -m gpu tests/quant/test_kernels_gpu.py alone (the quant kernels, Triton and Gluon)
#   bench_expert[:ARGS]   scripts/bench_expert_gemm.py: NVFP4 kernel vs decode+cuBLAS vs bf16 _grouped_mm at
#                         64..32768 tokens, grouped expert LoRA vs the per-expert loop at 65,536 tokens; ARGS ('+' for
#                         spaces) replace --lora-loop (e.g. bench_expert:--variants+--tokens+4096,32768)
#   bench_decode[:ARGS]   scripts/bench_nvfp4_decode.py: the NVFP4 weight decode alone at M3's expert chunks (asm tiles,
#                         integer fields, memory-bound references), ARGS ('+' for spaces) e.g. bench_decode:--base+base
#   bench_mxfp8           scripts/bench_mxfp8_linear.py --trainer (the trainer's projection shapes, 4 and 8 x 16K)
#   slice:L:S:BASE[:P[:C[:M]]]  scripts/train_step_m3.py at M3 width: L layers, S x 16K tokens, BASE quantized|bf16,
#                         activation checkpointing on, MoE chunks of C tokens (default 16384); P=1: the time split
#                         (with the host's ops during the GPU's idle gaps); P=2: also the step's Chrome trace;
#                         M=1: what is live at the peak of one more step, by allocation site (--memory-peak);
#                         SLICE_STEPS timed steps (default 2) after SLICE_WARMUP untimed ones (default 1); GC_FREEZE=0:
#                         the Python heap left unfrozen (train_step_m3.py --gc-freeze)
#   pairs:L:S:N[:base[:C]]  N rounds of the quantized and the bf16 slice (L layers, S x 16K tokens, SLICE_STEPS timed
#                         steps, default 4 here, after SLICE_WARMUP) side by side, alternating which goes first; with
#                         base: also base/'s quantized slice (base/ = another commit's tree, .whl linked) in each round;
#                         MoE chunks of C tokens as slice's (default 16384; 0: off, e.g. pairs:2:8:2::0). Ratios per
#                         round and their median in $OUT/pairs.json (scripts/gpu/slice_pairs.py, which refuses slices
#                         run differently), the slices in pairs.tgz (the call's next pairs step: pairs_2.json, ...)
#   trainer_tests         pytest -m gpu: the trainer fast-paths test (tests/rl/model/test_trainer_gpu.py) and the fused
#                         SwiGLU, add-norm backward and LM head softmax kernels (test_swiglu_triton.py,
#                         test_lean_triton.py, test_lm_head_triton.py)
#   block_tests           pytest -m gpu: the block-outer MSA kernels alone (tests/rl/model/test_msa_block_outer.py)
#   msa_tests             pytest -m gpu: the MSA kernels (block-outer, per-token, flex) and the trainer fast-paths test
#   ncu_msa[:LEN[:RE]]    Nsight Compute (--set full, clocks left alone) on the Gluon MSA forward and backward of one
#                         fwd+bwd at LEN tokens (default 32768), or the first 3 kernels matching the regex RE (e.g.
#                         _(merge|reduce_dq)): details and per-SASS-instruction pages as text, in $OUT/ncu_msa.tgz (the
#                         report itself, ~13 MB, is not kept)
#   ncu_expert[:TOKENS[:pairs]]  Nsight Compute (--set full, clocks left alone) on the expert GEMMs at TOKENS (default
#                         32768): Gluon input gradient (with pairs: also on pair-order weights), Triton forward, bf16
#                         _grouped_mm both ways, each launched once
#                         (scripts/gpu/ncu_expert.py); details and per-SASS pages as text in $OUT/ncu_expert.tgz
#   bench_msa[:ARGS]      scripts/bench_msa.py (4K-64K, 1 and 4 sequences, vs dense SDPA) with extra ARGS, '+' for
#                         spaces (e.g. bench_msa:--compare+triton+--sweep+32768); JSON to $OUT/bench_msa.json (the
#                         next bench_msa step of the call: bench_msa_2.json, ...)
# TRITON=V in the environment: every step under Triton V instead of the H200's 3.6.0, from a carried
# .whl/triton-V-cp312-sm90.tar.xz (scripts/gpu/triton_bundle.sh; e.g. TRITON=3.8.0, torch 2.14's)
# The device tool returns at most 8 files: logs go into logs.tgz, and the JSON results into results.tgz when
# there are more than 6 of them. The last lines printed are the summary (tokens/s, MFU, memory, time split).
source "$(dirname "$0")/lib.sh"
BUDGET=${RUN_BUDGET_S:-100000}  # seconds for all steps: a step starts only with time left, and is cut to it
# the trainer's GPU tests: its fast paths end to end and the kernels only it runs (fused SwiGLU, lean backwards, the
# LM head's softmax)
TRAINER_GPU_TESTS="tests/rl/model/test_trainer_gpu.py tests/rl/model/test_swiglu_triton.py tests/rl/model/test_lean_triton.py
  tests/rl/model/test_lm_head_triton.py"
lim() { local left=$(( BUDGET - SECONDS )); (( left < $1 )) && echo "$left" || echo "$1"; }
# NAME, else NAME_2, NAME_3 ...: the first with no $OUT/<it>.json (a step given twice in a call keeps both results)
fresh() { local name=$1 n=2; while [ -e "$OUT/$name.json" ]; do name=$1_$n; n=$((n + 1)); done; echo "$name"; }
# An Nsight Compute report $OUT/NAME.ncu-rep as text (details; per-SASS-instruction stall samples, which
# scripts/gpu/ncu_stalls.py reads) in $OUT/NAME.tgz, its headline numbers printed; the report itself is dropped.
ncu_pages() {
  ncu -i "$OUT/$1.ncu-rep" --page details > "$OUT/$1_details.txt" 2>&1
  ncu -i "$OUT/$1.ncu-rep" --page source --csv --print-source sass > "$OUT/$1_sass.txt" 2>&1
  grep -E "^  [_a-zA-Z]|Duration|Throughput|Executed Ipc A|Issue Slots Busy|No Eligible|Warp Cycles Per Issued" \
      "$OUT/$1_details.txt" | head -n 80
  (cd "$OUT" && tar czf "$1.tgz" "$1_details.txt" "$1_sass.txt" && rm -f "$1.ncu-rep" "$1_details.txt" "$1_sass.txt")
}
for step in "$@"; do
  if (( BUDGET - SECONDS < 30 )); then echo "$step skipped: out of RUN_BUDGET_S" | tee -a "$OUT/summary.log"; continue; fi
  case "$step" in
    tests)
      M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run tests "$(lim 300)" $P tests/quant/test_kernels_gpu.py \
          tests/quant/test_cuda_matches_cpu.py $TRAINER_GPU_TESTS ;;
    kernel_tests)
      run kernel_tests "$(lim 200)" $P tests/quant/test_kernels_gpu.py ;;
    bench_expert|bench_expert:*)
      extra=${step#bench_expert}; extra=${extra#:}; extra=${extra:---lora-loop}
      run bench_expert "$(lim 220)" python3 scripts/bench_expert_gemm.py ${extra//+/ } --out "$OUT/bench_expert.json" ;;
    bench_decode|bench_decode:*)
      extra=${step#bench_decode}; extra=${extra#:}
      run bench_decode "$(lim 120)" python3 scripts/bench_nvfp4_decode.py ${extra//+/ } --out "$OUT/bench_decode.json" ;;
    bench_mxfp8)
      run bench_mxfp8 "$(lim 100)" python3 scripts/bench_mxfp8_linear.py --trainer --out "$OUT/bench_mxfp8.json" ;;
    slice:*)
      IFS=: read -r _ layers seqs base prof chunk mpeak <<< "$step"
      p=${prof:-0}; chunk=${chunk:-16384}; trace=()
      name="slice${layers}x${seqs}_${base}$([ "$chunk" != 16384 ] && echo "_c$chunk")"
      (( p == 2 )) && p=1 && trace=(--trace "$OUT/$name.trace.json.gz")
      run "$name" "$(lim 240)" torchrun --nproc-per-node 1 scripts/train_step_m3.py --layers "$layers" --seq-len 16384 \
          --seqs-per-rank "$seqs" --steps "${SLICE_STEPS:-2}" --warmup-steps "${SLICE_WARMUP:-1}" --base "$base" \
          --shard-base 0 --moe-chunk-tokens "$chunk" --profile "$p" "${trace[@]}" --memory-peak "${mpeak:-0}" \
          --gc-freeze "${GC_FREEZE:-1}" --out "$OUT/$name.json" ;;
    pairs:*)
      IFS=: read -r _ layers seqs rounds with_base chunk <<< "$step"; chunk=${chunk:-16384}
      name=$(fresh pairs); out="$OUT/$name"; mkdir -p "$out"
      for ((i = 0; i < rounds; i++)); do
        order="quantized ${with_base:+base_quantized} bf16"; (( i % 2 )) && order="bf16 ${with_base:+base_quantized} quantized"
        for cfg in $order; do
          if (( BUDGET - SECONDS < 60 )); then
            echo "${name}_r${i}_$cfg skipped: out of RUN_BUDGET_S" | tee -a "$OUT/summary.log"; continue
          fi
          dir=.; [ "$cfg" = base_quantized ] && dir=base
          (cd "$dir" && run "${name}_r${i}_$cfg" "$(lim 150)" torchrun --nproc-per-node 1 scripts/train_step_m3.py \
              --layers "$layers" --seq-len 16384 --seqs-per-rank "$seqs" --steps "${SLICE_STEPS:-4}" \
              --warmup-steps "${SLICE_WARMUP:-1}" --base "${cfg#base_}" --shard-base 0 --moe-chunk-tokens "$chunk" \
              --gc-freeze "${GC_FREEZE:-1}" --out "$out/r${i}_$cfg.json")
        done
      done
      python3 scripts/gpu/slice_pairs.py "$out" --out "$OUT/$name.json" \
          --meta "{\"step\": \"$step\", \"slice_steps\": ${SLICE_STEPS:-4}}" | tee "$OUT/${name}_summary.log"
      (cd "$OUT" && tar czf "$name.tgz" "$name" && rm -rf "$name") ;;
    trainer_tests)
      M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run trainer_tests "$(lim 200)" $P -s $TRAINER_GPU_TESTS ;;
    block_tests)
      run block_tests "$(lim 200)" $P tests/rl/model/test_msa_block_outer.py ;;
    msa_tests)
      M3RL_GPU_REPORT="$OUT/trainer_gpu.json" run msa_tests "$(lim 380)" $P -s tests/rl/model/test_msa_block_outer.py \
          tests/rl/model/test_msa_triton.py tests/rl/model/test_msa.py tests/rl/model/test_trainer_gpu.py ;;
    ncu_msa|ncu_msa:*)
      IFS=: read -r _ len kre <<< "$step"; len=${len:-32768}; kre=${kre:-_(fwd|bwd)_gluon}
      run ncu_msa "$(lim 240)" ncu --clock-control none --set full --import-source no -k "regex:$kre" \
          -c 3 -f -o "$OUT/ncu_msa" python3 scripts/bench_msa.py --lengths "$len" --packed 1 --warmup 0 --repeats 1 \
          --no-sdpa
      ncu_pages ncu_msa ;;
    ncu_expert|ncu_expert:*)
      IFS=: read -r _ tok pairs <<< "$step"; tok=${tok:-32768}
      run ncu_expert "$(lim 240)" ncu --clock-control none --set full --import-source no --profile-from-start off \
          -f -o "$OUT/ncu_expert" python3 scripts/gpu/ncu_expert.py --tokens "$tok" \
          ${pairs:+--pairs}
      ncu_pages ncu_expert ;;
    bench_msa|bench_msa:*)
      extra=${step#bench_msa}; extra=${extra#:}
      name=$(fresh bench_msa)
      run "$name" "$(lim 420)" python3 scripts/bench_msa.py ${extra//+/ } --out "$OUT/$name.json" ;;
    *) echo "unknown step $step" | tee -a "$OUT/summary.log" ;;
  esac
done
grep -h -E "passed|failed|Error|error" "$OUT"/*.log | grep -v DEBUG | tail -n 15
python3 - "$OUT" <<'EOF'
import glob, json, os, sys
for f in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    r = json.load(open(f))
    name = os.path.basename(f)
    if name.startswith("slice"):
        rk = r["ranks"][0]
        print(name, "tok/s", round(r["tokens_per_s"] or 0), "mfu", round(r.get("mfu_vs_989_tflops") or 0, 4),
              "peak", round(r["peak_allocated_gb_max"], 1), "mem", {k: round(v, 1) for k, v in
                                                                   rk.get("memory_breakdown_gb", {}).items()},
              "split", {k: v for k, v in rk.get("time_split", {}).items()
                        if k not in ("top_kernels", "gpu_idle", "by_op")})
        for k in rk.get("time_split", {}).get("top_kernels", [])[:15]:
            print("  ", k["ms"], "ms", k["launches"], k["category"], k["op"][:40], k["kernel"][:70])
        for k in rk.get("time_split", {}).get("by_op", [])[:25]:
            print("   op", k["ms"], "ms", k["launches"], k["category"], k["op"][:60])
        idle = rk.get("time_split", {}).get("gpu_idle")
        if idle:
            print(name, "GPU idle", idle["idle_ms"], "ms of", idle["span_ms"], "in", idle["gaps"], "gaps")
            for g in idle["idle_by_neighbours"][:10]:
                print("   idle", round(g["us"] / 1e3, 2), "ms", g["gaps"], "gaps after", g["after"][:45], "before",
                      g["before"][:45])
        if "memory_at_peak" in rk:
            print(name, "at peak", json.dumps(rk["memory_at_peak"]["live_at_peak_by_site_gb"]))
    elif name.startswith("bench_msa"):
        sys.path.insert(0, "scripts")
        from bench_msa import table
        print(table(r))
    elif "totals" in r:
        print(name, json.dumps(r["totals"]))
        if "lora" in r:
            print(name, "lora", json.dumps(r["lora"]))
EOF
pack_logs
if [ "$(ls "$OUT"/*.json 2>/dev/null | wc -l)" -gt 6 ]; then (cd "$OUT" && tar czf results.tgz *.json && rm -f *.json); fi
cat "$OUT/summary.log"
