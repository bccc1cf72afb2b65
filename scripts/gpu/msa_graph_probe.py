"""Probe for issue 18's short-sequence target: one MSA fwd+bwd (rl.model.msa_block_outer) with its host work replayed
from two CUDA graphs (plan + forward, backward) against the eager call and dense causal SDPA (eager and graphed), one
call and back to back, at 4K-8K tokens (single sequence, M3 shapes). Not a product path: a graph reads and writes the
buffers it was captured with, so a model would copy each layer's q/k/v/ids in and o/lse/plan out (the "+ copies" rows
time that too).

    python scripts/gpu/msa_graph_probe.py --lengths 4096,8192 --out results/gpu/runNN/msa_graph_probe.json

Prints one JSON document (the command first) and a table last; the graphed call's outputs and gradients are compared
with the eager call's (max |difference|).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "..", ".."), os.path.join(HERE, "..")]
from bench_msa import emit, make_case, timed  # noqa: E402  (scripts/)
from rl.model import msa  # noqa: E402
from rl.model import msa_block_outer as mbo  # noqa: E402


def capture(fn, warm: int = 2) -> torch.cuda.CUDAGraph:
    """fn()'s launches as a CUDA graph (after `warm` eager runs on a side stream, as capture needs)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warm):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def m3_args(args):
    """bench_msa's case shapes (M3: 64 q / 4 KV heads, d 128, index dim 128, top-16, one local block) on args."""
    args.hq, args.hkv, args.dim, args.index_dim = 64, 4, 128, 128
    args.topk, args.init_blocks, args.local_blocks = 16, 0, 1
    return args


def single_case(total, args, device, gen):
    """One bf16 sequence of `total` tokens: q, k, v (requiring grad), its block ids, cu_seqlens as a list, the
    softmax scale, an output gradient and the resolved block-outer Config."""
    _, cu, index_q, index_k, q, k, v = make_case(total, 1, args, device, torch.bfloat16, gen)
    ids = msa.select_blocks(index_q, index_k, cu, args.topk, args.init_blocks, args.local_blocks)
    # (from the CPU generator: after a graph captured SDPA, the device generator is the graph's)
    do = torch.randn(q.shape, generator=gen).to(device, q.dtype)
    return q, k, v, ids, cu.tolist(), args.dim ** -0.5, do, mbo._kernels(q, k, mbo.DEFAULT)


def probe(total, args, device, gen):
    q, k, v, ids, cu_host, scale, do, config = single_case(total, args, device, gen)

    def eager():
        out = mbo.sparse_attention(q, k, v, ids, cu_host, scale)
        return out, *torch.autograd.grad(out, (q, k, v), do)

    # the graphed call: static inputs (q, k, v, ids, do), outputs and the plan between the two graphs
    sq, sk, sv, sdo = (x.detach().clone() for x in (q, k, v, do))
    sids = ids.clone()
    o, lse = torch.empty_like(sq), torch.empty(sq.shape[:2], dtype=torch.float32, device=device)
    dq, dk, dv = torch.empty_like(sq), torch.empty_like(sk), torch.empty_like(sv)
    state = {}

    def fwd():
        state["plan"] = mbo.build_plan(sids, cu_host, config)
        mbo._forward(sq, sk, sv, None, state["plan"], scale, config, o, lse)

    def bwd():
        mbo._backward(sq, sk, sv, o, lse, sdo, state["plan"], scale, config, dq, dk, dv)

    def plan_only():  # the plan alone, for the case that launches the kernels eagerly
        state["plan_only"] = mbo.build_plan(sids, cu_host, config)

    row = {"tokens": total}
    try:
        g_fwd = capture(fwd)
        g_fwd.replay()  # the captured plan's tables hold data only once replayed: the backward's warm-up reads them
        g_bwd = capture(bwd)
        g_plan = capture(plan_only)
    except Exception as exc:  # noqa: BLE001 (a capture failure is the probe's answer)
        row["capture_error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
        return row

    def plan_graphed():  # the plan from a graph (ids copied in), the kernels launched eagerly
        sids.copy_(ids)
        g_plan.replay()
        out = mbo._BlockOuter.apply(q, k, v, [(0, total, state["plan_only"])], scale, config, None)
        return out, *torch.autograd.grad(out, (q, k, v), do)

    def graphed():
        g_fwd.replay()
        g_bwd.replay()

    def graphed_copies():  # what a model would add per layer: inputs in, outputs out
        for dst, src in ((sq, q), (sk, k), (sv, v), (sids, ids)):
            dst.copy_(src)
        g_fwd.replay()
        out = o.clone()
        sdo.copy_(do)
        g_bwd.replay()
        return out, dq.clone(), dk.clone(), dv.clone()

    ref = eager()
    got = graphed_copies()
    torch.cuda.synchronize()
    row["max_abs_diff"] = {n: float((a.detach().float() - b.float()).abs().max()) for n, a, b in
                           zip(("o", "dq", "dk", "dv"), ref, got)}

    def sdpa():
        qs, ks, vs = (x.transpose(0, 1)[None] for x in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)[0].transpose(0, 1)
        return torch.autograd.grad(out, (q, k, v), do)

    sdpa_graph = None
    try:
        sdpa_graph = capture(sdpa)
    except Exception as exc:  # noqa: BLE001
        row["sdpa_capture_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    cases = {"msa_eager": eager, "msa_plan_graph": plan_graphed, "msa_graphs": graphed,
             "msa_graphs_copies": graphed_copies, "sdpa_eager": sdpa}
    if sdpa_graph is not None:
        cases["sdpa_graph"] = sdpa_graph.replay
    n = args.back_to_back
    for name, fn in cases.items():
        row[name] = timed(fn, args.warmup, args.repeats, device)
        row[name + "_b2b"] = {key: x / n for key, x in
                              timed(lambda f=fn: [f() for _ in range(n)], 1, args.repeats, device).items()}
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lengths", default="4096,8192")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--back-to-back", type=int, default=4)
    p.add_argument("--out", default=None)
    args = m3_args(p.parse_args())
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    report = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv), "torch": torch.__version__,
              "device": torch.cuda.get_device_name(device),
              "results": [probe(int(t), args, device, gen) for t in args.lengths.split(",")]}
    lines = []
    for r in report["results"]:
        lines.append(f"{r['tokens']} {r.get('capture_error', '')} {r.get('max_abs_diff', '')}")
        lines += [f"  {name:18s} single {r[name]['median_ms']:6.3f} ms (host {r[name]['host_ms']:5.3f})"
                  f"  b2b {r[name + '_b2b']['median_ms']:6.3f}"
                  for name in ("msa_eager", "msa_plan_graph", "msa_graphs", "msa_graphs_copies", "sdpa_eager",
                               "sdpa_graph") if name in r]
    emit(report, "\n".join(lines), args.out)


if __name__ == "__main__":
    main()
