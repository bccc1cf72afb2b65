"""Loading a 1M-row verl-schema file, before vs after rows became an Arrow-backed view (issue 17, item 4).

    python scripts/bench_data_load.py --rows 1000000 --out results/data_load_1m.json

Writes a parquet file of `--rows` distinct DAPO-style rows (pyarrow, vectorised), builds `datasets`' Arrow cache
once, then measures each side in a fresh child process (so peak RSS is that side's own), the same file and cache:
- before: rl/data.py as of --before-commit (read from git), i.e. `load_dapo_math_17k` returning a list of dicts,
  then `encode_prompts` over every row, as rl/session.py did at start;
- after: this tree's `load_dapo_math_17k` (a `Rows` view), then what rl/session.py does now before step 1: the
  `TrainPrompts.first_fit` check and the first batch drawn and tokenized.
Per side: load seconds, RSS (and its anonymous part, RssAnon: without the memory-mapped file's pages) after load,
peak RSS of the load, seconds to the first batch's token ids, RSS then, peak RSS overall (VmHWM, reset after the
imports; ru_maxrss for the whole process). Prints and writes one JSON object.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

import rl.data as data  # noqa: E402
from m3.tiny import ensure_tiny_model  # noqa: E402
from rl.prompts import DataCursor, TrainPrompts  # noqa: E402


def _const(text: str, n: int) -> pa.Array:
    # a gather of one value: pa.array of a large numpy string array comes back chunked, which StructArray refuses
    return pa.array([text], pa.string()).take(pa.array(np.zeros(n, dtype=np.int32)))


def write_synthetic(path, n: int, duplicate_every: int = 0, pad_every: int = 0) -> None:
    """`n` DAPO-style verl rows (the DAPO prompt around a distinct problem), in a second or two for 1M rows.
    `duplicate_every`: row i repeats row i - 1's content when i % duplicate_every == 0 (its own index);
    `pad_every`: a zero-padded ground truth ("0123") when i % pad_every == 0."""
    i = np.arange(n, dtype=np.int64)
    k = i if not duplicate_every else np.where((i % duplicate_every == 0) & (i > 0), i - 1, i)
    head, tail = data.DAPO_PROMPT.split("{problem}")
    ks = pa.array(k).cast(pa.string())
    content = pc.binary_join_element_wise(head + "Let x be the number of ways to choose ", ks,
                                          " items. Find x modulo 1000." + tail, "")
    answer = pa.array(k % 1000).cast(pa.string())
    if pad_every:
        answer = pc.if_else(pa.array(i % pad_every == 0), pc.binary_join_element_wise("0", answer, ""), answer)
    message = pa.StructArray.from_arrays([_const("user", n), content], ["role", "content"])
    table = pa.table({
        "data_source": _const("math_dapo", n),
        "prompt": pa.ListArray.from_arrays(pa.array(np.arange(n + 1, dtype=np.int32)), message),
        "ability": _const("MATH", n),
        "reward_model": pa.StructArray.from_arrays([_const("rule-lighteval/MATH_v2", n), answer],
                                                   ["style", "ground_truth"]),
        "extra_info": pa.StructArray.from_arrays([pa.array(i)], ["index"]),
    })
    pq.write_table(table, path)


def _rss_gb(field: str = "VmRSS") -> float:
    """VmRSS counts the memory-mapped Arrow pages read so far (file-backed, evictable); RssAnon is the heap alone."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def _peak_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # kB on Linux


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM (ru_maxrss is not resettable)


def _peak_since_reset_gb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e9
    return float("nan")


def _old_data_module(commit: str):
    src = subprocess.run(["git", "show", f"{commit}:rl/data.py"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    path = Path(tempfile.mkdtemp()) / "old_data.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("old_data", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["old_data"] = module  # its dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def child(side: str, path: str, cache: str, tokenizer_dir: str, commit: str, batch: int, load_only: bool) -> dict:
    import datasets  # noqa: F401  (imported before the baseline: both sides pay it)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    loader = _old_data_module(commit) if side == "before" else data
    base, base_anon = _rss_gb(), _rss_gb("RssAnon")
    _reset_peak()
    t0, c0 = time.perf_counter(), time.process_time()
    rows, report = loader.load_dapo_math_17k(path, cache_dir=cache)
    t_load, c_load = time.perf_counter() - t0, time.process_time() - c0
    out = {"rows_kept": len(rows), "load_s": round(t_load, 2), "load_cpu_s": round(c_load, 2),
           "baseline_rss_gb": round(base, 3),
           "rss_after_load_gb": round(_rss_gb(), 3), "load_peak_rss_gb": round(_peak_since_reset_gb(), 3),
           "baseline_anon_gb": round(base_anon, 3), "anon_after_load_gb": round(_rss_gb("RssAnon"), 3)}
    if load_only:
        return out
    t1 = time.perf_counter()
    if side == "before":
        kept, ids, _ = loader.encode_prompts(rows, tok, 2048)
        cursor = loader.DataCursor(len(kept), seed=0)
        first = [ids[i] for i in cursor.next_batch(batch)]
    else:
        prompts = TrainPrompts(rows, tok, 2048)
        prompts.first_fit()
        _, first = prompts.draw(DataCursor(len(rows), seed=0), batch)
    out.update(first_batch_s=round(time.perf_counter() - t1, 2), first_batch_prompts=len(first),
               rss_at_first_batch_gb=round(_rss_gb(), 3), anon_at_first_batch_gb=round(_rss_gb("RssAnon"), 3),
               peak_rss_gb=round(_peak_since_reset_gb(), 3),
               process_max_rss_gb=round(_peak_gb(), 3))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--out", type=Path, default=None, help="JSON result file")
    p.add_argument("--work", type=Path, default=None, help="folder for the file and the cache (default: a temp dir)")
    p.add_argument("--before-commit", default="b488842", help="the commit whose rl/data.py is 'before'")
    p.add_argument("--batch", type=int, default=64, help="prompts in the first batch (the DAPO recipe's 64)")
    p.add_argument("--load-repeats", type=int, default=2,
                   help="more load-only runs per side, alternating sides: the machine may be shared, take the min")
    p.add_argument("--child", choices=("before", "after"), help=argparse.SUPPRESS)
    p.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--file", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.child, args.file, args.cache, args.tokenizer, args.before_commit, args.batch,
                               args.load_only)))
        return {}

    scratch = None if args.work else tempfile.TemporaryDirectory(prefix="bench_data_")  # removed at exit
    work = args.work or Path(scratch.name)
    work.mkdir(parents=True, exist_ok=True)
    path, cache = work / f"verl_{args.rows}.parquet", work / "cache"
    t0 = time.perf_counter()
    write_synthetic(path, args.rows)
    t_write = time.perf_counter() - t0
    t0 = time.perf_counter()
    data.open_dataset(path, cache)  # datasets' Arrow copy, built once: both sides then read the same cache
    t_cache = time.perf_counter() - t0
    tokenizer = str(ensure_tiny_model(dtype="float32").vllm)
    result = {"command": "python " + " ".join([str(Path(__file__).relative_to(ROOT)), *(argv or sys.argv[1:])]),
              "rows": args.rows, "file_mb": round(path.stat().st_size / 1e6, 1), "write_s": round(t_write, 2),
              "arrow_cache_build_s": round(t_cache, 2), "loader": "load_dapo_math_17k (dedup, int normalisation)",
              "tokenizer": "tiny M3 (m3.tiny), max_prompt_length 2048", "first_batch": args.batch,
              "machine": {"cpus": os.cpu_count(), "loadavg_at_start": [round(x, 2) for x in os.getloadavg()]},
              "notes": ["VmRSS includes the memory-mapped Arrow file's pages read so far (file-backed, evictable); "
                        "RssAnon (anon_*) is the process heap alone: Python objects, numpy, Arrow buffers",
                        "first_batch_s: before = encode_prompts over every row (rl/session.py at start), then the "
                        "cursor's first batch; after = TrainPrompts.first_fit + the first batch drawn and tokenized",
                        "load_runs_s: the first full run then load-only runs alternating sides; the machine may be "
                        "shared (loadavg), so ratios use each side's minimum"]}
    def run_child(side: str, *extra: str) -> dict:
        cmd = [sys.executable, __file__, "--child", side, "--file", str(path), "--cache", str(cache),
               "--tokenizer", tokenizer, "--before-commit", args.before_commit, "--batch", str(args.batch), *extra]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)))
        if proc.returncode:
            raise SystemExit(f"{side} side failed:\n{proc.stderr[-3000:]}")
        out = json.loads(proc.stdout.strip().splitlines()[-1])
        print(side, *extra, out, file=sys.stderr, flush=True)
        return out

    for side in ("before", "after"):
        result[side] = run_child(side)
        result[side]["load_runs_s"], result[side]["load_runs_cpu_s"] = [result[side]["load_s"]], [
            result[side]["load_cpu_s"]]
    for r in range(args.load_repeats):
        for side in (("after", "before") if r % 2 == 0 else ("before", "after")):
            again = run_child(side, "--load-only")
            result[side]["load_runs_s"].append(again["load_s"])
            result[side]["load_runs_cpu_s"].append(again["load_cpu_s"])
    result["machine"]["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
    b, a = result["before"], result["after"]
    result["after_over_before"] = {
        "load_s_min": round(min(a["load_runs_s"]) / min(b["load_runs_s"]), 3),
        "load_cpu_s_min": round(min(a["load_runs_cpu_s"]) / min(b["load_runs_cpu_s"]), 3),
        "load_growth_rss": round((a["rss_after_load_gb"] - a["baseline_rss_gb"])
                                 / (b["rss_after_load_gb"] - b["baseline_rss_gb"]), 4),
        "load_growth_anon": round((a["anon_after_load_gb"] - a["baseline_anon_gb"])
                                  / (b["anon_after_load_gb"] - b["baseline_anon_gb"]), 4),
        "growth_to_first_batch_anon": round((a["anon_at_first_batch_gb"] - a["baseline_anon_gb"])
                                            / (b["anon_at_first_batch_gb"] - b["baseline_anon_gb"]), 4),
        "to_first_batch_s": round((a["load_s"] + a["first_batch_s"]) / (b["load_s"] + b["first_batch_s"]), 4),
        "peak_rss": round(a["peak_rss_gb"] / b["peak_rss_gb"], 3)}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return result


if __name__ == "__main__":
    main()
