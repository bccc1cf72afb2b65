"""Time MSA (rl.model.msa) forward+backward against dense causal SDPA, one sequence per length.

    python scripts/bench_msa.py                                   # 4K/16K/32K/64K, 64 q / 4 KV heads, d=128, bf16
    python scripts/bench_msa.py --lengths 4096 --packed 4 --repeats 5 --out results/msa.json

Each case reports the median (and min/max) over --repeats timed runs after --warmup runs, with CUDA events:
- select: `select_blocks` (no grad), index heads = KV heads, top-k of the visible blocks;
- msa_fwd / msa_fwd_bwd: `sparse_attention` (its index tables / block mask built inside, validation off), backward
  w.r.t. q, k, v; --impl triton (rl.model.msa_triton, the default), flex or reference;
- sdpa_fwd / sdpa_fwd_bwd: `scaled_dot_product_attention(is_causal=True, enable_gqa=True)` on the same q, k, v;
- tiles (flex): KV tiles listed per Q tile in the BlockMask (the union of the 128 queries' selections; top-k is the
  floor); union (triton): key blocks each group of tokens visits (union of its tokens' selections);
- peak memory of the MSA and SDPA fwd+bwd.
Index q/k are built so neighbouring queries mostly agree (a per-64-token topic plus noise), like real text; fully
random ones would make every Q tile's union approach the whole prefix.
Prints one JSON document, "command" first; --out also writes it.
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from rl.model import msa  # noqa: E402

BLOCK_KEYS = msa.BLOCK
SWEEP = [(1, 4, 3), (2, 4, 3), (2, 4, 4), (2, 8, 3), (4, 4, 3)]  # (tokens per group, warps, stages)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096,16384,32768,65536", help="total tokens per case, comma separated")
    p.add_argument("--packed", type=int, default=1, help="split each length into this many sequences")
    p.add_argument("--hq", type=int, default=64)
    p.add_argument("--hkv", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--index-dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=16)
    p.add_argument("--init-blocks", type=int, default=0)
    p.add_argument("--local-blocks", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--impl", default="triton", choices=["triton", "flex", "reference"])
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--no-sdpa", action="store_true", help="skip the dense baseline")
    p.add_argument("--sweep", action="store_true",
                   help="triton: also time fwd+bwd for other tokens-per-group / num_warps / num_stages")
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="also write the JSON here")
    return p.parse_args()


def timed(fn, warmup, repeats, device):
    """Median/min/max milliseconds of fn() over `repeats` runs after `warmup` (CUDA events; wall clock on CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times)}


def peak_memory(fn, device):
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 30


def make_case(total, args, device, dtype, gen):
    base, extra = divmod(total, args.packed)
    lengths = [base + (i < extra) for i in range(args.packed)]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    topic = torch.randn(total // 64 + 1, args.hkv, args.index_dim, generator=gen).repeat_interleave(64, 0)[:total]
    index_q = (topic + 0.5 * torch.randn(total, args.hkv, args.index_dim, generator=gen)).to(device)
    index_k = torch.randn(total, args.index_dim, generator=gen).to(device)
    q, k, v = (torch.randn(total, h, args.dim, generator=gen).to(device, dtype).requires_grad_()
               for h in (args.hq, args.hkv, args.hkv))
    return lengths, cu, index_q, index_k, q, k, v


def bench_length(total, args, device, dtype, gen):
    lengths, cu, index_q, index_k, q, k, v = make_case(total, args, device, dtype, gen)
    select = lambda: msa.select_blocks(index_q, index_k, cu, args.topk, args.init_blocks, args.local_blocks)  # noqa
    ids = select()
    msa.validate_block_ids(ids, cu, init_blocks=args.init_blocks, local_blocks=args.local_blocks)
    grad_out = torch.randn(total, args.hq, args.dim, device=device, dtype=dtype)
    row = {"tokens": total, "lengths": lengths}
    row["select"] = timed(select, args.warmup, args.repeats, device)

    if args.impl == "flex":
        block_mask, _ = msa.build_block_mask(ids, cu)
        listed = (block_mask.kv_num_blocks + block_mask.full_kv_num_blocks).float()
        row["tiles"] = {"mean_per_q_tile": listed.mean().item(), "max_per_q_tile": listed.max().item(),
                        "full_fraction": (block_mask.full_kv_num_blocks.sum() / listed.sum()).item(),
                        "topk": args.topk}
        row["block_mask"] = timed(lambda: msa.build_block_mask(ids, cu), args.warmup, args.repeats, device)

    if args.impl == "triton":
        from rl.model import msa_triton

        plan = msa_triton.build_plan(ids, cu, max(1, min(8, 16 // (args.hq // args.hkv))))  # msa_triton's default
        row["union"] = {"mean_per_group": plan.count.float().mean().item(), "max_per_group": int(plan.count.max()),
                        "tokens_per_group": plan.tokens_per_group, "topk": args.topk,
                        "dkdv_programs": plan.chunk_kb.numel()}
        row["plan"] = timed(lambda: msa_triton.build_plan(ids, cu, plan.tokens_per_group), args.warmup, args.repeats,
                            device)
        # QK^T and PV over 128-key blocks: selected (at most topk per query) vs visited (the group's union)
        per_block = 4 * total * args.hq * args.dim * BLOCK_KEYS / 1e12
        row["tflop_fwd_selected_max"] = per_block * args.topk
        row["tflop_fwd_computed"] = per_block * row["union"]["mean_per_group"]

    def msa_fwd():
        with torch.no_grad():
            msa.sparse_attention(q, k, v, ids, cu, impl=args.impl, validate=False)

    def msa_fwd_bwd():
        out = msa.sparse_attention(q, k, v, ids, cu, impl=args.impl, validate=False)
        torch.autograd.grad(out, (q, k, v), grad_out)

    if args.impl == "triton" and args.sweep:
        row["sweep"] = []
        for tt, warps, stages in SWEEP:
            def variant():
                out = msa_triton.sparse_attention(q, k, v, ids, cu, args.dim ** -0.5, tokens_per_group=tt,
                                                  num_warps=warps, num_stages=stages)
                torch.autograd.grad(out, (q, k, v), grad_out)
            try:
                t = timed(variant, 1, args.repeats, device)
            except Exception as exc:  # noqa: BLE001 (a config that does not fit is a result too)
                t = {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
            row["sweep"].append({"tokens_per_group": tt, "num_warps": warps, "num_stages": stages, **t})

    row["msa_fwd"] = timed(msa_fwd, args.warmup, args.repeats, device)
    row["msa_fwd_bwd"] = timed(msa_fwd_bwd, args.warmup, args.repeats, device)
    row["msa_peak_gib"] = peak_memory(msa_fwd_bwd, device)

    if not args.no_sdpa:
        # Dense baseline on the same tokens; packed cases run one causal SDPA per sequence.
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

        def sdpa_fwd_bwd():
            torch.autograd.grad(sdpa(), (q, k, v), grad_out)

        row["sdpa_fwd"] = timed(sdpa_fwd, args.warmup, args.repeats, device)
        row["sdpa_fwd_bwd"] = timed(sdpa_fwd_bwd, args.warmup, args.repeats, device)
        row["sdpa_peak_gib"] = peak_memory(sdpa_fwd_bwd, device)
        row["msa_over_sdpa_fwd_bwd"] = row["msa_fwd_bwd"]["median_ms"] / row["sdpa_fwd_bwd"]["median_ms"]
    return row


def main():
    args = parse_args()
    device = torch.device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype]
    report = {
        "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "results": [],
    }
    gen = torch.Generator().manual_seed(args.seed)
    for total in (int(x) for x in args.lengths.split(",")):
        report["results"].append(bench_length(total, args, device, dtype, gen))
        print(json.dumps(report["results"][-1]), file=sys.stderr, flush=True)  # progress
        if device.type == "cuda":
            torch.cuda.empty_cache()
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
