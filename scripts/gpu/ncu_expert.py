"""The routed-expert GEMMs of scripts/bench_expert_gemm.py at one token count, each launched once between
cudaProfilerStart/Stop, for Nsight Compute (scripts/gpu/run.sh ncu_expert): the gate_up input gradient by the
warp-specialized Gluon kernel (its sm_90 default config at 97-767 rows per expert; with --pairs also on the weights in
pair order), the gate_up forward by the Triton
kernel (its default tiles for these rows), and the bf16 torch._grouped_mm forward and input gradient they are
measured against. Random weights and uniform top-4 routing, as the benchmark. Prints each call's time once warm.

    ncu --profile-from-start off ... python3 scripts/gpu/ncu_expert.py --tokens 32768
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench_expert_gemm import E, SHAPES, TOPK, random_weights, uniform_routing  # noqa: E402

from quant.kernels import nvfp4_moe_gemm as gemm  # noqa: E402
from quant.kernels.e2m1_asm import to_pair_order  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--pairs", action="store_true",
                    help="also the Gluon input gradient on the weights in e2m1_asm's pair order (config PAIRS)")
    args = ap.parse_args()
    torch.manual_seed(0)
    n, k = SHAPES["gate_up"]
    packed, scale, gs, wbf = random_weights(n, k)
    offsets = uniform_routing(args.tokens)
    m = args.tokens * TOPK
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
    offs_end = offsets[1:].contiguous()
    calls = {
        "gluon_dgrad": lambda: gemm.launch_dgrad(dy, packed, scale, gs, offsets, config=gemm.GLUON_DGRAD_CONFIG),
    }
    if args.pairs:
        pairs, cfg = to_pair_order(packed), dict(gemm.GLUON_DGRAD_CONFIG, PAIRS=True)
        calls["gluon_dgrad_pairs"] = lambda: gemm.launch_dgrad(dy, pairs, scale, gs, offsets, config=cfg)
    calls |= {
        "triton_fwd": lambda: gemm.launch_fwd(x, packed, scale, gs, offsets, config=gemm.fwd_config(m, E)),
        "bf16_grouped_mm_fwd": lambda: torch._grouped_mm(x, wbf.transpose(1, 2), offs=offs_end),
        "bf16_grouped_mm_dgrad": lambda: torch._grouped_mm(dy, wbf, offs=offs_end),
    }
    for name, fn in calls.items():  # compile and warm up outside the profiled range
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        print(f"{name}: {start.elapsed_time(end):.3f} ms ({m // E} rows per expert, gate_up)", flush=True)
    torch.cuda.cudart().cudaProfilerStart()
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


if __name__ == "__main__":
    main()
