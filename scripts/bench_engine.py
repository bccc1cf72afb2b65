"""Benchmark: vLLM engine start and a 16-prompt x 32-token generate for the tiny MiniMax-M3 on this machine.

Runs each measurement in a fresh process (engine start includes vLLM's imports), repeats, reports medians, and
writes results/engine_cpu.json with the command that produced it.

Usage: python scripts/bench_engine.py [--repeats 3] [--dtype bfloat16] [--out results/engine_cpu.json]
Targets (foundation issue): start <= 20 s, generate <= 5 s on the 2-core CPU machine.
"""

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def one_run(dtype: str) -> dict:
    """Child process: build the engine, time one cold and one warm generate."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams

    from m3.tiny import ensure_tiny_model

    paths = ensure_tiny_model(dtype=dtype)
    t_import = time.perf_counter()
    llm = LLM(model=str(paths.vllm), dtype=dtype, enforce_eager=True, max_model_len=2048, max_num_seqs=16,
              kv_cache_memory_bytes=64 << 20, seed=0, distributed_executor_backend="uni")
    t_start = time.perf_counter()
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 480 + 10 for j in range(24)]} for i in range(16)]
    sp = SamplingParams(temperature=1.0, max_tokens=32, ignore_eos=True, seed=0, logprobs=0)
    times = []
    for _ in range(2):
        t = time.perf_counter()
        outs = llm.generate(prompts, sp, use_tqdm=False)
        times.append(time.perf_counter() - t)
    assert all(len(o.outputs[0].token_ids) == 32 for o in outs)
    return {"import_s": t_import - t0, "engine_start_s": t_start - t_import, "start_total_s": t_start - t0,
            "generate_first_s": times[0], "generate_warm_s": times[1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--out", default=str(ROOT / "results" / "engine_cpu.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(one_run(args.dtype)))
        return
    runs = []
    for _ in range(args.repeats):
        p = subprocess.run([sys.executable, __file__, "--child", "--dtype", args.dtype], cwd=ROOT,
                           capture_output=True, text=True, check=True)
        runs.append(json.loads(next(l for l in p.stdout.splitlines() if l.startswith("RESULT "))[7:]))
    median = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    result = {
        "command": f"python scripts/bench_engine.py --repeats {args.repeats} --dtype {args.dtype}",
        "workload": "tiny MiniMax-M3 (scripts/make_tiny_model.py defaults), in-process engine, enforce_eager; "
                    "16 prompts x 24 tokens -> 32 new tokens each, temperature 1.0",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "median": median, "runs": runs,
        "targets": {"start_total_s": 20.0, "generate_first_s": 5.0},
        "meets_targets": median["start_total_s"] <= 20.0 and median["generate_first_s"] <= 5.0,
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["median"], indent=2), "meets targets:", result["meets_targets"])


if __name__ == "__main__":
    main()
