"""Time MSA (rl.model.msa) forward and forward+backward against dense causal SDPA, single and packed sequences, one run.

    python scripts/bench_msa.py                      # 4K-64K, 1 and 4 sequences, 64 q / 4 KV heads, d=128, bf16
    python scripts/bench_msa.py --lengths 32768 --packed 1 --compare triton --sweep 32768 --out results/msa.json

Each case reports the median (and min/max) over --repeats timed runs after --warmup runs, with CUDA events:
- select: `select_blocks` (no grad), index heads = KV heads, top-k of the visible blocks;
- msa_fwd / msa_fwd_bwd: `sparse_attention` with --impl (block: rl.model.msa_block_outer, the default; triton: the
  per-token kernels; flex; reference), its index tables built inside, validation off, backward w.r.t. q, k, v;
  --compare IMPL,... adds fwd and fwd+bwd of other implementations on the same inputs;
- sdpa_fwd / sdpa_fwd_bwd: `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` per sequence;
- dense_path_fwd_bwd (packed cases, CUDA): the whole batch's dense causal attention through
  rl.model.msa_dense.causal_dense, the path a batch of sequences within topk blocks takes (one varlen
  FlashAttention call or SDPA per sequence, by its `prefers_varlen`; runs 110-112 stored it as varlen_fwd_bwd);
- useful TFLOP/s: the attention FLOPs on the keys each query attends to (its selected blocks, causal; dense: every
  earlier key), 4*D per (query head, key) forward and 3.5x that forward+backward (2 + 5 matmuls), over the time;
- --sweep LENGTHS: block-outer tile/launch variants (rl.model.msa_block_outer.Config) timed fwd (forward fields) or
  fwd+bwd (backward fields, and back to back with --back-to-back) at those lengths, single sequence;
- --profile LENGTHS: GPU time per kernel of one fwd+bwd (torch.profiler), single sequence;
- --trace LENGTHS: Chrome traces (host ops, CUDA runtime calls, GPU kernels; one more with Python frames) of one
  fwd+bwd and of 3 back to back, single sequence, gzipped beside --out: where the GPU waits for the host;
- --back-to-back N: also msa and sdpa fwd+bwd timed as N calls in a row between the events, per call (*_b2b): the
  host work of one call then overlaps the GPU work of the previous one, as in a model's layers (no sync inside).
Index q/k are built so neighbouring queries mostly agree (a per-64-token topic plus noise), like real text.
Prints one JSON document, "command" first, and a table last; --out also writes the JSON.
"""

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import gpu_idle  # noqa: E402  (scripts/, this file's folder)
from rl.model import msa  # noqa: E402

# Config fields changed from rl.model.msa_block_outer.DEFAULT: SWEEP_FWD timed forward only, SWEEP_BWD forward+backward.
# Earlier lists (tile rows, warps, stages, orders, item sizes, atomic dQ): results/gpu/run12c; 64-key backward
# programs (fewer register spills, two dQ partials per block), 1 backward stage, 4 forward stages: run14 (all slower).
# Gluon backward (run21-23): 256-token items, dQ stored while the next tile's MMAs run (run22), dQ stored straight from
# the MMA layout, dQ issued before dK (run23): all slower than the default. Gluon backward vs Triton, 64-row merge
# tiles: run24 (Triton 28.0 vs 26.4 ms at 32K; row_tile 64 26.7). Triton forward vs Gluon (10.2 vs 9.2 ms fwd at 32K),
# 128-row Gluon forward tiles (10.9): run32. Merge / dQ sum / delta on 8 warps (merge 4.3 vs 2.5 ms at 32K: one program
# per SM at 179 registers), 64-row tiles on 8 warps: run34 (88eb7ca). Merge / dQ sum with their slot loop unrolled
# (tl.static_range) on 32-row tiles: merge 3.08 vs 2.48 ms, dQ sum 2.01 vs 2.14 at 32K (run35; 128-row tiles spill).
# Warp-specialized Gluon backward vs _bwd_gluon (24.06 vs 25.03 ms fwd+bwd at 32K), the Triton forward (25.74), size
# order (26.29), 128- / 256-token items (26.14 / 27.21; at 4K 3.42 / 3.27 vs 3.43): run44. Its dQ stored by TMA vs
# from registers (24.08 vs 24.43 ms at 32K, 47.45 vs 49.29 at 64K), 3 ring stages (24.25), _bwd_gluon (25.79): run45.
# The warp-specialized forward (TMA loader, two math warpgroups on alternate tiles) vs _fwd_gluon: 8.44 vs 9.04 ms
# fwd, 22.78 vs 23.56 fwd+bwd at 32K; 256-token items (24.96), the dense prefix through SDPA (25.60; 4.59 vs 3.33 at
# 4K): run46. Both defaults against the kernels they replaced (run47): fwd+bwd 22.44 vs 23.40 (_fwd_gluon) vs 24.39
# (_fwd_gluon and _bwd_gluon) ms at 32K, 44.61 / 48.96 / 48.97 at 64K, 3.18 / 3.18 / 3.35 at 4K.
# With the host tables cached per batch layout (run60): the dense prefix through SDPA (3.46 vs 2.88 ms at 4K, 24.17 vs
# 22.21 at 32K) and 256-token items (2.97, 24.13) again slower. The forward's adjacent selected blocks as one 256-key
# entry (run72-73, results/gpu/run73/pairs_not_kept.patch): fwd+bwd 22.40 vs 21.87 ms at 32K, 3.09 vs 2.85 at 4K.
# Item sizes again (run74-75): 768 tokens 22.25 vs 22.78 ms at 32K in one call, 23.36 vs 22.72 in the next (noise);
# 640 and 1024 slower. The dK/dV sum on 32-column programs vs one program per key block (run83): 4K fwd+bwd 2.72 vs
# 2.94 ms single, 2.32 vs 2.39 back to back; _reduce_dkdv 0.024 vs 0.069 ms at 4K, 0.19 vs 0.29 at 32K.
# Launch order "key" (then no second sort of the plan) against the default "token" (run91): fwd+bwd 2.98 vs 2.80 ms
# at 4K (back to back 2.44 vs 2.30), 21.37 vs 21.18 at 32K; kept "token", the plan now sorts it in its own kernel.
# The dense prefix through SDPA queued before the plan (run96): fwd+bwd 3.00 vs 2.68 ms at 4K, 22.55 vs 21.42 at 32K.
# Next: short calls' plans replayed from a CUDA graph per batch layout (the default) against their launches.
SWEEP_FWD = [dict(), dict(plan_graphs=False)]
SWEEP_BWD = [dict(), dict(plan_graphs=False)]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096,8192,16384,32768,65536", help="total tokens per case, comma separated")
    p.add_argument("--packed", default="1,4", help="sequences per case (each length split evenly), comma separated")
    p.add_argument("--hq", type=int, default=64)
    p.add_argument("--hkv", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--init-blocks", type=int, default=0)
    p.add_argument("--local-blocks", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--impl", default="block", choices=["block", "triton", "flex", "reference"])
    p.add_argument("--compare", default="", help="other impls to time on the same inputs, comma separated")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-sdpa", action="store_true", help="skip the dense baseline")
    p.add_argument("--sweep", default="", help="lengths at which to time block-outer variants, comma separated")
    p.add_argument("--back-to-back", type=int, default=0, help="also time N fwd+bwd calls in a row (0: off)")
    p.add_argument("--config", default="", help="block-outer Config fields for --impl block, e.g. "
                   "item_tokens=256,order=size (the table, --profile, --trace; --sweep varies the default)")
    p.add_argument("--profile", default="", help="lengths at which to list fwd+bwd kernel times (torch.profiler)")
    p.add_argument("--trace", default="", help="lengths at which to write Chrome traces of fwd+bwd (next to --out)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p.parse_args()


def timed(fn, warmup, repeats, device):
    """Median/min/max milliseconds of fn() over `repeats` runs after `warmup` (CUDA events; wall clock on CPU);
    on CUDA also host_ms, the median time until fn() returns (its launches, and any sync inside it)."""
    for _ in range(warmup):
        fn()
    times, host = [], []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            t0 = time.perf_counter()
            fn()
            host.append((time.perf_counter() - t0) * 1e3)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    out = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}
    return {**out, "host_ms": statistics.median(host)} if host else out


def peak_memory(fn, device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def make_case(total, packed, args, device, dtype, gen):
    base, extra = divmod(total, packed)
    lengths = [base + (i < extra) for i in range(packed)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    topic = torch.randn(total // 64 + 1, args.hkv, args.index_dim, generator=gen).repeat_interleave(64, 0)[:total]
    index_q = (topic + 0.5 * torch.randn(total, args.hkv, args.index_dim, generator=gen)).to(device)
    index_k = torch.randn(total, args.index_dim, generator=gen).to(device)
    q, k, v = (torch.randn(total, h, args.dim, generator=gen).to(device, dtype).requires_grad_()
               for h in (args.hq, args.hkv, args.hkv))
    return lengths, cu, index_q, index_k, q, k, v


def useful_tflop(ids, cu, hq, dim):
    """(sparse, dense causal) forward TFLOP: 4*D per (query head, attended key)."""
    pos = msa.token_positions(cu, ids.device)[:, None, None]
    keys = torch.where(ids.long() == pos // msa.BLOCK, pos % msa.BLOCK + 1, msa.BLOCK) * (ids >= 0)
    g = hq // ids.shape[1]
    return 4 * dim * g * float(keys.sum()) / 1e12, 4 * dim * hq * float((pos + 1).sum()) / 1e12


def bench_case(total, packed, args, device, dtype, gen):
    lengths, cu, index_q, index_k, q, k, v = make_case(total, packed, args, device, dtype, gen)
    select = lambda: msa.select_blocks(index_q, index_k, cu, args.topk, args.init_blocks, args.local_blocks)  # noqa
    ids = select()
    msa.validate_block_ids(ids, cu, init_blocks=args.init_blocks, local_blocks=args.local_blocks)
    grad_out = torch.randn(total, args.hq, args.dim, device=device, dtype=dtype)
    row = {"tokens": total, "sequences": packed, "lengths": lengths}
    row["select"] = timed(select, args.warmup, args.repeats, device)
    sparse_tf, dense_tf = useful_tflop(ids, cu, args.hq, args.dim)
    row["useful_tflop_fwd"] = {"msa": sparse_tf, "dense": dense_tf}
    if args.impl == "block":
        from rl.model import msa_block_outer

        cfg = args.block_config or msa_block_outer.DEFAULT
        row["plan"] = timed(lambda: msa_block_outer.build_plan(ids, cu, cfg), args.warmup, args.repeats, device)

    def run_msa(impl, backward, **kw):
        def fn():
            with torch.set_grad_enabled(backward):
                out = attend(q, k, v, ids, cu, impl, args, **kw)
                if backward:
                    torch.autograd.grad(out, (q, k, v), grad_out)
        return fn

    for impl in [args.impl] + [c for c in args.compare.split(",") if c and c != args.impl]:
        key = "msa" if impl == args.impl else impl
        row[f"{key}_fwd"] = timed(run_msa(impl, False), args.warmup, args.repeats, device)
        row[f"{key}_fwd_bwd"] = timed(run_msa(impl, True), args.warmup, args.repeats, device)
        row[f"{key}_peak_gib"] = peak_memory(run_msa(impl, True), device)
    for name, fl in (("fwd", sparse_tf), ("fwd_bwd", 3.5 * sparse_tf)):
        row[f"msa_{name}_tflops"] = fl / row[f"msa_{name}"]["median_ms"] * 1e3

    if not args.no_sdpa:
        bounds = list(zip(cu[:-1].tolist(), cu[1:].tolist()))

        def sdpa():
            outs = []
            for s, e in bounds:
                qs, ks, vs = (x[s:e].transpose(0, 1)[None] for x in (q, k, v))
                outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0]
                            .transpose(0, 1))
            return torch.cat(outs)

        def sdpa_fwd():
            with torch.no_grad():
                sdpa()

        row["sdpa_fwd"] = timed(sdpa_fwd, args.warmup, args.repeats, device)
        row["sdpa_fwd_bwd"] = timed(lambda: torch.autograd.grad(sdpa(), (q, k, v), grad_out), args.warmup,
                                    args.repeats, device)
        row["sdpa_fwd_bwd_tflops"] = 3.5 * dense_tf / row["sdpa_fwd_bwd"]["median_ms"] * 1e3
        row["msa_over_sdpa_fwd_bwd"] = row["msa_fwd_bwd"]["median_ms"] / row["sdpa_fwd_bwd"]["median_ms"]
        if packed > 1 and device.type == "cuda":
            from rl.model import msa_dense

            dense = lambda: msa_dense.causal_dense(q, k, v, lengths, args.dim ** -0.5)  # noqa: E731
            row["dense_path_fwd_bwd"] = timed(lambda: torch.autograd.grad(dense(), (q, k, v), grad_out), args.warmup,
                                              args.repeats, device)
    n = args.back_to_back
    if n > 0:
        fns = {"msa": run_msa(args.impl, True)}
        if not args.no_sdpa:
            fns["sdpa"] = lambda: torch.autograd.grad(sdpa(), (q, k, v), grad_out)
        for name, fn in fns.items():
            t = timed(lambda: [fn() for _ in range(n)], 1, args.repeats, device)
            row[f"{name}_fwd_bwd_b2b"] = {k: x / n for k, x in t.items()}
        if "sdpa" in fns:
            row["msa_over_sdpa_fwd_bwd_b2b"] = (row["msa_fwd_bwd_b2b"]["median_ms"]
                                                / row["sdpa_fwd_bwd_b2b"]["median_ms"])
    return row


def sweep(total, args, device, dtype, gen):
    from rl.model import msa_block_outer as mbo

    _, cu, index_q, index_k, q, k, v = make_case(total, 1, args, device, dtype, gen)
    ids = msa.select_blocks(index_q, index_k, cu, args.topk, args.init_blocks, args.local_blocks)
    grad_out = torch.randn(total, args.hq, args.dim, device=device, dtype=dtype)
    rows = []
    for fields, forward_only in [(f, True) for f in SWEEP_FWD] + [(f, False) for f in SWEEP_BWD]:
        cfg = dataclasses.replace(mbo.DEFAULT, **fields)

        def fn():
            with torch.set_grad_enabled(not forward_only):
                out = mbo.sparse_attention(q, k, v, ids, cu, args.dim ** -0.5, cfg)
                if not forward_only:
                    torch.autograd.grad(out, (q, k, v), grad_out)
        n = args.back_to_back
        try:
            t = timed(fn, 1, args.repeats, device)
            if n > 0 and not forward_only:
                b2b = timed(lambda: [fn() for _ in range(n)], 1, args.repeats, device)
                t["b2b_median_ms"] = b2b["median_ms"] / n
        except Exception as exc:  # noqa: BLE001 (a config that does not compile or fit is a result too)
            t = {"error": f"{type(exc).__name__}: {str(exc)[:300]}"}
        rows.append({"tokens": total, "timed": "fwd" if forward_only else "fwd_bwd", **fields, **t})
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    return rows


def single_fwd_bwd(total, args, device, dtype, gen):
    """fn() running one fwd+bwd of --impl on a single sequence of `total` tokens (its inputs built once)."""
    _, cu, index_q, index_k, q, k, v = make_case(total, 1, args, device, dtype, gen)
    ids = msa.select_blocks(index_q, index_k, cu, args.topk, args.init_blocks, args.local_blocks)
    grad_out = torch.randn(total, args.hq, args.dim, device=device, dtype=dtype)

    def fn():
        out = attend(q, k, v, ids, cu, args.impl, args)
        torch.autograd.grad(out, (q, k, v), grad_out)
    return fn


def attend(q, k, v, ids, cu, impl, args, **kw):
    """msa.sparse_attention with `impl`; the block impl with --config's Config where one is given."""
    if impl == "block" and args.block_config is not None:
        from rl.model import msa_block_outer as mbo

        return mbo.sparse_attention(q, k, v, ids, cu, q.shape[-1] ** -0.5, args.block_config)
    return msa.sparse_attention(q, k, v, ids, cu, impl=impl, validate=False, **kw)


def block_config(args):
    """The block-outer Config of --config "field=value,..." (values cast by the field's default), None without one;
    parsed once, before any timing."""
    if not args.config:
        return None
    from rl.model import msa_block_outer as mbo

    items = [item.split("=", 1) for item in args.config.split(",")]
    cast = {f.name: type(f.default) for f in dataclasses.fields(mbo.Config)}
    values = {}
    for item in items:
        if len(item) != 2 or item[0] not in cast:
            raise SystemExit(f"--config: {'='.join(item)!r} is not FIELD=VALUE with a field of {sorted(cast)}")
        name, text = item
        try:
            values[name] = text.lower() in ("1", "true") if cast[name] is bool else cast[name](text)
        except ValueError:
            raise SystemExit(f"--config: {name}={text!r} is not a {cast[name].__name__}") from None
    return mbo.Config(**values)


def profile(total, args, device, dtype, gen):
    """GPU time per kernel of one fwd+bwd (mean of 3), single sequence: where the time goes."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn = single_fwd_bwd(total, args, device, dtype, gen)
    fn()
    torch.cuda.synchronize()
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        ms = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)) / 1e3 / 3
        if ms > 0:
            rows.append({"kernel": e.key[:90], "ms": ms, "calls": e.count / 3})
    rows.sort(key=lambda r: -r["ms"])
    # The GPU's idle time inside the three calls: gaps between consecutive kernels (the largest, with their
    # neighbours), and the span from the first kernel's start to the last one's end
    idle = gpu_idle.idle_gaps(gpu_idle.kernel_spans(prof.events()))
    return {"tokens": total, "kernels_ms_total": sum(r["ms"] for r in rows), "kernels": rows[:25],
            "span_ms": idle["span_us"] / 1e3 / 3 or None, "idle_ms": idle["idle_us"] / 1e3 / 3,
            "largest_gaps": idle["largest_gaps"]}


def trace(total, args, device, dtype, gen, out_dir):
    """Chrome traces of fwd+bwd after warm-up, single sequence: one call and 3 back to back with host ops, CUDA
    runtime calls and kernels, and one call with Python frames too (the profiler's own cost inflates that one)."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    fn = single_fwd_bwd(total, args, device, dtype, gen)
    for _ in range(3):
        fn()
    paths = []
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for name, calls, stack in (("single", 1, False), ("b2b3", 3, False), ("single_stack", 1, True)):
        sync()
        with torch_profile(activities=activities, with_stack=stack) as prof:
            for _ in range(calls):
                fn()
            sync()
        path = os.path.join(out_dir, f"trace_{total}_{name}.json.gz")
        prof.export_chrome_trace(path)  # torch gzips a path ending in .gz
        paths.append(path)
    return paths


def table(report):
    lines = ["tokens seqs | select plan | msa fwd  fwd+bwd (TFLOP/s fwd, f+b) host fwd f+b | sdpa fwd  fwd+bwd "
             "(TFLOP/s) | ratio"
             + "".join(f" | {c} f+b" for c in report["config"]["compare"].split(",") if c)]
    for r in report["results"]:
        line = (f"{r['tokens']:6d} {r['sequences']:4d} | {r['select']['median_ms']:6.2f} "
                f"{r.get('plan', {}).get('median_ms', float('nan')):5.2f} | {r['msa_fwd']['median_ms']:7.2f} "
                f"{r['msa_fwd_bwd']['median_ms']:8.2f} ({r['msa_fwd_tflops']:4.0f}, {r['msa_fwd_bwd_tflops']:4.0f}) "
                + " ".join(f"{r[k].get('host_ms', float('nan')):5.2f}" for k in ("msa_fwd", "msa_fwd_bwd")))
        if "sdpa_fwd" in r:
            line += (f" | {r['sdpa_fwd']['median_ms']:7.2f} {r['sdpa_fwd_bwd']['median_ms']:8.2f} "
                     f"({r['sdpa_fwd_bwd_tflops']:4.0f}) | {r['msa_over_sdpa_fwd_bwd']:.2f}")
        if "msa_fwd_bwd_b2b" in r:
            line += f" | b2b {r['msa_fwd_bwd_b2b']['median_ms']:7.2f}"
            if "sdpa_fwd_bwd_b2b" in r:
                line += f" {r['sdpa_fwd_bwd_b2b']['median_ms']:7.2f} {r['msa_over_sdpa_fwd_bwd_b2b']:.2f}"
        if "dense_path_fwd_bwd" in r:
            line += f" | dense path f+b {r['dense_path_fwd_bwd']['median_ms']:7.2f}"
        for c in (c for c in report["config"]["compare"].split(",") if c):
            if f"{c}_fwd_bwd" in r:
                line += f" | {r[f'{c}_fwd_bwd']['median_ms']:8.2f}"
        lines.append(line)
    for s in report.get("sweep", []):
        lines.append(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}" for k, v in s.items()
                              if k not in ("min_ms", "max_ms")))
    for p in report.get("profile", []):
        lines.append(f"profile {p['tokens']}: kernels {p['kernels_ms_total']:.2f} ms per fwd+bwd"
                     + (f", span {p['span_ms']:.2f}, idle {p['idle_ms']:.2f}" if p.get("span_ms") else ""))
        lines += [f"   gap {g['us']:8.1f} us after {g['after']} before {g['before']}"
                  for g in p.get("largest_gaps", [])]
        lines += [f"  {r['ms']:7.3f} ms {r['calls']:5.1f}x {r['kernel']}" for r in p["kernels"][:12]]
    return "\n".join(lines)


def main():
    args = parse_args()
    args.block_config = block_config(args)  # a bad --config fails here, before any work
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "config": {k: v for k, v in vars(args).items() if k not in ("out", "block_config")},
        "results": [],
    }
    gen = torch.Generator().manual_seed(args.seed)
    if args.sweep:
        report["sweep"] = [r for total in args.sweep.split(",") for r in sweep(int(total), args, device, dtype, gen)]
    for packed in (int(x) for x in args.packed.split(",")):
        for total in (int(x) for x in args.lengths.split(",")):
            report["results"].append(bench_case(total, packed, args, device, dtype, gen))
            print(json.dumps(report["results"][-1]), file=sys.stderr, flush=True)  # progress
            if device.type == "cuda":
                torch.cuda.empty_cache()
    for total in (int(x) for x in args.profile.split(",") if x):
        try:
            report.setdefault("profile", []).append(profile(total, args, device, dtype, gen))
        except Exception as exc:  # noqa: BLE001 (the timings above stand without it)
            report["profile_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    out_dir = os.path.dirname(os.path.abspath(args.out)) if args.out else os.getcwd()  # traces beside the JSON
    for total in (int(x) for x in args.trace.split(",") if x):
        os.makedirs(out_dir, exist_ok=True)
        report.setdefault("traces", []).extend(trace(total, args, device, dtype, gen, out_dir))
    emit(report, table(report), args.out)


def emit(report: dict, summary: str, out: str | None) -> None:
    """The report as JSON on stdout, then the summary lines; also the JSON to `out` if given."""
    text = json.dumps(report, indent=2)
    print(text)
    print(summary)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
