"""Probe for issue 18's 4K target: where the host time of one MSA call (rl.model.msa_block_outer) goes. Each stage of
the plan, the forward and the backward is launched on its own many times and timed on the host (the median time until
it returns; the GPU is synchronized between batches of launches, outside the timing, so no launch waits on a full
queue), next to empty Triton kernels (1 and 16 arguments, launched through the JIT and as the compiled kernel) and
torch ops of the same sizes. A torch profile of one eager fwd+bwd follows (host time per op).

    python scripts/gpu/msa_host_probe.py --lengths 4096 --out results/gpu/runNN/msa_host_probe.json

Prints one JSON document (the command first) and a table last. Not a product path.
"""

import argparse
import os
import statistics
import sys
import time

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..")]
from bench_msa import emit  # noqa: E402  (scripts/)
from gpu.msa_graph_probe import m3_args, single_case  # noqa: E402  (scripts/gpu/)
from rl.model import msa_block_outer as mbo  # noqa: E402
from rl.model import msa_block_outer_gluon_ws as ws  # noqa: E402
from rl.model import msa_block_plan as mbp  # noqa: E402


class _Identity(torch.autograd.Function):
    """The cheapest custom Function: the autograd engine's own cost of a backward."""

    @staticmethod
    def forward(ctx, x):  # noqa: D102
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        return g


@triton.jit
def _nop1(x_ptr):
    pass


@triton.jit
def _nop16(a, b, c, d, e, f, g, h, n0, n1, n2, n3, n4, n5, n6, n7, X: tl.constexpr):
    pass


def host_us(fn, n: int = 200, batch: int = 8) -> float:
    """Median host microseconds until fn() returns; the GPU drained every `batch` calls, outside the timing."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for i in range(n):
        if i % batch == 0:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize()
    return round(statistics.median(times), 1)


def probe(total, args, device, gen):
    q, k, v, ids, cu_host, scale, do, config = single_case(total, args, device, gen)
    t_count, hkv, topk = ids.shape
    hq, dim = q.shape[1], q.shape[2]
    g = hq // hkv
    plan = mbo.build_plan(ids, cu_host, config)
    seq_d, nseq, kstart_d, kend_d, _, nkb, _, _ = mbp._device_tables(
        tuple(mbp.seq_bounds(cu_host)), t_count, topk, config.dense_prefix_min, device)
    ne, n_max = t_count * hkv * topk, plan.n_max
    gid = torch.empty(t_count, hkv, topk, dtype=torch.int32, device=device)
    key16 = torch.empty(ne, dtype=torch.int16, device=device)
    mbp._plan_keys[(triton.cdiv(ne, 1024),)](ids, seq_d, gid, key16, ne, nseq, nkb, *ids.stride(), HKV=hkv,
                                             TOPK=topk, BE=1024)
    skey, sidx = torch.sort(key16, stable=True)
    entries = torch.empty(ne, dtype=torch.int32, device=device)
    pos = torch.empty(t_count, hkv, topk, dtype=torch.int32, device=device)
    tabs = torch.empty(5 * n_max + hkv * nkb + 1, dtype=torch.int32, device=device)
    item_key, lo, hi, okey, order, key_item0 = tabs.split([n_max] * 5 + [hkv * nkb + 1])
    tm, bm = mbo.tile_shape(config.fwd_rows, g)
    opart = torch.empty(ne * g, dim, dtype=q.dtype, device=device)
    lpart = torch.empty(ne * g, dtype=torch.float32, device=device)
    qk_scale = scale * 1.4426950408889634
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=device)
    descs = ws.fwd_ws_descriptors(q, k, v, opart, g, bm)
    items = (plan.entries, plan.order, plan.item_key, plan.item_lo, plan.item_hi, plan.kstart)
    x = torch.empty(16, device=device)
    nop1 = _nop1[(1,)](x)
    nop16 = _nop16[(1,)](*[x] * 8, *range(1, 9), X=4)
    merge_args = (opart, lpart, plan.slot_pos, plan.slot_pos, o, o, lse, t_count * hq)
    merge_kw = dict(HQ=hq, HKV=hkv, G=g, TOPK=topk, D=dim, R=config.row_tile, HAS_DENSE=False, TP=topk)
    merge_grid = (triton.cdiv(t_count * hq, config.row_tile),)
    merge_ck = mbo._merge[merge_grid](*merge_args, **merge_kw)
    merge_all = (*merge_args, *merge_kw.values())
    qd, kd, vd = (x.detach() for x in (q, k, v))

    def fwd_bwd():
        out = mbo.sparse_attention(q, k, v, ids, cu_host, scale)
        return torch.autograd.grad(out, (q, k, v), do)

    grad_state = {}

    def fwd_for_bwd():
        grad_state["out"] = mbo.sparse_attention(q, k, v, ids, cu_host, scale)

    def bwd_only():
        if "out" not in grad_state:
            fwd_for_bwd()
        torch.autograd.grad(grad_state.pop("out"), (q, k, v), do)

    def fwd_bwd_one_thread():
        with torch.autograd.set_multithreading_enabled(False):
            return fwd_bwd()

    small = torch.zeros(16, device=device, requires_grad=True)
    small_g = torch.ones(16, device=device)

    stages = {
        "identity_fn_grad": lambda: torch.autograd.grad(_Identity.apply(small), small, small_g),
        "nop1_jit": lambda: _nop1[(1,)](x),
        "nop1_compiled": lambda: nop1[(1, 1, 1)](x),
        "nop16_jit": lambda: _nop16[(1,)](*[x] * 8, *range(1, 9), X=4),
        "nop16_compiled": lambda: nop16[(1, 1, 1)](*[x] * 8, *range(1, 9), 4),
        "torch_empty": lambda: torch.empty(ne, dtype=torch.int32, device=device),
        "torch_zeros": lambda: torch.zeros(ne, dtype=torch.int32, device=device),
        "torch_arange": lambda: torch.arange(n_max, device=device),
        "seq_bounds+device_tables": lambda: mbp._device_tables(tuple(mbp.seq_bounds(cu_host)), t_count, topk,
                                                               config.dense_prefix_min, device),
        "plan_keys": lambda: mbp._plan_keys[(triton.cdiv(ne, 1024),)](ids, seq_d, gid, key16, ne, nseq, nkb,
                                                                      *ids.stride(), HKV=hkv, TOPK=topk, BE=1024),
        "sort_entries_int16": lambda: torch.sort(key16, stable=True),
        "plan_index": lambda: mbp._plan_index[(triton.cdiv(ne, 1024) + 1,)](
            skey, sidx, entries, pos, key_item0, item_key, lo, hi, okey, order, ne, max(ne, 1).bit_length(),
            hkv * nkb, n_max, config.item_tokens, HKVTOPK=hkv * topk, SIZE_ORDER=False,
            NP=triton.next_power_of_2(n_max) if n_max <= mbp.KERNEL_SORT_MAX else 0, BE=1024, CH=1024),
        "sort_items": lambda: torch.sort(okey, stable=True).indices,
        "build_plan": lambda: mbo.build_plan(ids, cu_host, config),
        "resolve_config": lambda: mbo._kernels(q, k, mbo.DEFAULT),
        "fwd_descriptors": lambda: ws.fwd_ws_descriptors(q, k, v, opart, g, bm),
        "fwd_kernel_launch": lambda: ws._fwd_gluon_ws[(n_max,)](*descs, lpart, *items, nkb, qk_scale, HQ=hq, HKV=hkv,
                                                                G=g, TOPK=topk, TM=tm, **ws.WS_FWD),
        "merge_jit": lambda: mbo._merge[merge_grid](*merge_args, **merge_kw),
        "merge_compiled": lambda: merge_ck[(merge_grid[0], 1, 1)](*merge_all),
        "forward_fn": lambda: mbo._forward(qd, kd, vd, None, plan, scale, config, o, lse),
        "backward_fn": lambda: mbo._backward(qd, kd, vd, o, lse, do, plan, scale, config, torch.empty_like(qd),
                                             torch.empty_like(kd), torch.empty_like(vd)),
        "sparse_attention_nograd": lambda: mbo.sparse_attention(qd, kd, vd, ids, cu_host, scale),
        "sparse_attention_grad": fwd_for_bwd,
        "autograd_backward": bwd_only,
        "fwd_bwd": fwd_bwd,
        "fwd_bwd_one_thread": fwd_bwd_one_thread,
    }
    row = {"tokens": total, "n_max": n_max, "entries": ne, "host_us": {}}
    for name, fn in stages.items():
        try:
            row["host_us"][name] = host_us(fn)
        except Exception as exc:  # noqa: BLE001 (a failing stage is part of the answer)
            row["host_us"][name] = f"{type(exc).__name__}: {str(exc)[:300]}"
    # when the backward body runs inside torch.autograd.grad: (entry, exit) after the grad call, microseconds
    marks, inner = [], mbo._backward

    def timed_backward(*a, **kw):
        t1 = time.perf_counter()
        inner(*a, **kw)
        marks[-1] += [t1, time.perf_counter()]

    mbo._backward = timed_backward
    try:
        for multithreaded in (True, False):
            spans = []
            for i in range(60):
                torch.cuda.synchronize()
                out = mbo.sparse_attention(q, k, v, ids, cu_host, scale)
                marks.append([time.perf_counter()])
                with torch.autograd.set_multithreading_enabled(multithreaded):
                    torch.autograd.grad(out, (q, k, v), do)
                t0, t1, t2 = marks[-1]
                spans.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6, (time.perf_counter() - t2) * 1e6))
            row["grad_spans_us" + ("" if multithreaded else "_one_thread")] = {
                "to_backward_body": round(statistics.median(s[0] for s in spans[10:]), 1),
                "backward_body": round(statistics.median(s[1] for s in spans[10:]), 1),
                "after_body": round(statistics.median(s[2] for s in spans[10:]), 1)}
    finally:
        mbo._backward = inner
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        fwd_bwd()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fwd_bwd()
        torch.cuda.synchronize()
    row["profile"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096")
    p.add_argument("--out", default=None)
    args = m3_args(p.parse_args())
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "torch": torch.__version__,
              "triton": triton.__version__, "device": torch.cuda.get_device_name(device),
              "results": [probe(int(t), args, device, gen) for t in args.lengths.split(",")]}
    lines = []
    for r in report["results"]:
        lines.append(f"{r['tokens']} tokens, {r['entries']} entries, {r['n_max']} item rows")
        lines += [f"  {name:26s} {us}" for name, us in r["host_us"].items()]
        lines += [f"  {name}: {r[name]}" for name in ("grad_spans_us", "grad_spans_us_one_thread")]
        lines.append(r["profile"])
    emit(report, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
