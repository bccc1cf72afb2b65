"""Benchmark the NVFP4 routed-expert grouped GEMM (quant.kernels.nvfp4_moe, nvfp4_moe_gemm) at real M3 shapes.

128 experts, hidden 6144, expert intermediate 3072: gate_up (w13) 6144 -> 6144 and down (w2)
3072 -> 6144, top-4 uniform routing, tokens in {64, 512, 4096, 32768}. Forward and input gradient,
against the bf16 baseline ``torch._grouped_mm`` on the same routing (per-expert loop if that is
unavailable). Reports median time, TFLOP/s, GB/s (weights of experts with rows + activations in +
out), ratio vs bf16, and time over the NVFP4 weight-byte floor (active experts' weights at
0.5625 B/param over the copy bandwidth, 4.30 TB/s unless measured with --measure-copy).

Writes JSON with the command line at the top:
    python scripts/bench_expert_gemm.py --out results/gpu/bench_expert_gemm.json
"""

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from quant.kernels import nvfp4_dequant as nd  # noqa: E402
from quant.kernels import nvfp4_moe as moe  # noqa: E402
from quant.kernels import nvfp4_moe_gemm as gemm  # noqa: E402
from quant.kernels.e2m1_asm import to_pair_order  # noqa: E402

E, HIDDEN, INTER, TOPK = 128, 6144, 3072, 4
COPY_TBPS = 4.30
SHAPES = {"gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}  # (N, K)


def bench(fn, rep_ms):
    import triton

    return triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 5), rep=rep_ms, return_mode="median")


def measure_copy():
    a = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a), 100)
    del a, b
    return 2 * 2 * 1024**3 / (ms * 1e-3) / 1e12


def grouped_mm_fn(x, w, offs_end, transpose):
    """bf16 baseline on the same routing: torch._grouped_mm, else a per-expert loop."""
    b = w.transpose(1, 2) if transpose else w
    try:
        out = torch._grouped_mm(x, b, offs=offs_end)
        torch.cuda.synchronize()
        return (lambda: torch._grouped_mm(x, b, offs=offs_end)), "torch._grouped_mm", out
    except Exception as exc:  # noqa: BLE001
        bounds = [0] + offs_end.tolist()
        print(f"_grouped_mm unavailable ({type(exc).__name__}: {exc}); per-expert loop", flush=True)

        def loop():
            outs = [x[bounds[i]:bounds[i + 1]] @ b[i] for i in range(len(bounds) - 1)]
            return torch.cat(outs)

        return loop, "per-expert torch.mm loop", loop()


# Gluon kernel configs timed by --variants / --gluon-variants at >= 4096 tokens (label, config)
# (PAIRS: the weights in e2m1_asm's pair order, pair_weights in main)
GLUON_VARIANTS = (("BM=128", dict(BM=128)), ("BM=256", dict(BM=256)), ("BM=256,DW=8", dict(BM=256, DW=8, DREGS=64)),
                  ("BM=256,PAIRS", dict(BM=256, PAIRS=True)),
                  ("BM=256,DW=8,PAIRS", dict(BM=256, DW=8, DREGS=64, PAIRS=True)))


def random_weights(n, k):
    """One projection [N, K] of all E experts, random: NVFP4 codes, E4M3 block scales (bytes 0x28-0x6F: finite,
    normal), global decode scales, and a bf16 stand-in of the same shape for the baseline."""
    packed = torch.randint(0, 256, (E, n, k // 2), dtype=torch.uint8, device="cuda")
    scale = torch.randint(0x28, 0x70, (E, n, k // 16), dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    gs = (torch.rand(E, device="cuda") * 1e-3 + 1e-4).float()
    wbf = torch.randn(E, n, k, device="cuda", dtype=torch.bfloat16)
    return packed, scale, gs, wbf


def uniform_routing(tokens):
    """Expert offsets [E+1] of tokens x top-4 rows sorted by expert, top-4 of iid uniform scores per token."""
    ids = torch.rand(tokens, E, device="cuda").topk(TOPK, dim=1).indices
    return moe.sort_by_expert(ids, E)[1]


def bench_lora(tokens, loop, rep_ms, rank=32):
    """Expert LoRA (gate_up + down, rank 32, fp32 masters) fwd+bwd on tokens x top-4 routed rows: grouped
    (rl.model.lora.grouped_lora_delta, torch._grouped_mm) vs the per-expert loop it replaced; and the bf16 base gate_up
    _grouped_mm for scale."""
    from rl.model.lora import ExpertLoRA, LoRAConfig

    lora = ExpertLoRA(E, HIDDEN, INTER, LoRAConfig(rank=rank, alpha=2 * rank)).cuda()
    with torch.no_grad():
        for p in (lora.gate_up_B, lora.down_B):
            p.normal_(0, 0.01)
    offsets = uniform_routing(tokens)
    m = tokens * TOPK
    x = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(m, INTER, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    gu = torch.randn(m, 2 * INTER, device="cuda", dtype=torch.bfloat16)
    gd = torch.randn(m, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def grouped():
        lora.gate_up_grouped(x, offsets).backward(gu)
        lora.down_grouped(a, offsets).backward(gd)

    def per_expert():
        b = offsets.tolist()
        torch.cat([lora.gate_up(x[b[i]:b[i + 1]], i) for i in range(E)]).backward(gu)
        torch.cat([lora.down(a[b[i]:b[i + 1]], i) for i in range(E)]).backward(gd)

    out = {"tokens": tokens, "rows": m, "rank": rank}
    out["grouped_fwd_bwd_ms"] = round(bench(grouped, rep_ms), 3)
    w = torch.randn(E, 2 * INTER, HIDDEN, device="cuda", dtype=torch.bfloat16)
    out["bf16_base_gate_up_fwd_ms"] = round(bench(lambda: torch._grouped_mm(x.detach(), w.transpose(1, 2),
                                                                            offs=offsets[1:]), rep_ms), 3)
    if loop:
        per_expert()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        per_expert()
        torch.cuda.synchronize()
        out["loop_fwd_bwd_ms_one_run"] = round((time.perf_counter() - t0) * 1e3, 1)
    print("LoRA", json.dumps(out), flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="64,512,2048,4096,8192,16384,32768")
    ap.add_argument("--lora-tokens", type=int, default=65536, help="grouped expert LoRA fwd+bwd at this many tokens")
    ap.add_argument("--lora-loop", action="store_true", help="also time the per-expert LoRA loop (slow)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--measure-copy", action="store_true")
    ap.add_argument("--variants", action="store_true", help="also time the 'triton' decoder and alt tiles")
    ap.add_argument("--gluon-variants", action="store_true", help="also time the Gluon kernel's GLUON_VARIANTS")
    ap.add_argument("--pairs", action="store_true",
                    help="also time the kernels on weights in e2m1_asm's pair order (Triton 'pairs' decoder; Gluon "
                         "PAIRS where the input gradient's default is the Gluon kernel)")
    ap.add_argument("--rep-ms", type=int, default=60)
    ap.add_argument("--side-priority", type=int, default=None,
                    help="the decode + cuBLAS path's side-stream priority (nvfp4_dequant.SIDE_PRIORITY; 0 = normal)")
    args = ap.parse_args()
    if args.side_priority is not None:
        nd.SIDE_PRIORITY = args.side_priority
    torch.manual_seed(0)
    dev = torch.cuda.get_device_name()
    import triton

    copy_tbps = measure_copy() if args.measure_copy else COPY_TBPS
    res = {
        "command": "python " + " ".join(sys.argv),
        "device": dev,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "copy_TBps_used_for_floor": round(copy_tbps, 3),
        "copy_TBps_measured": args.measure_copy,
        "dequant_side_priority": nd.SIDE_PRIORITY,
        "experts": E, "hidden": HIDDEN, "intermediate": INTER, "top_k": TOPK,
        "routing": "uniform: top-4 of iid uniform scores per token",
        "decoder_default": gemm.DEFAULT_DECODER,
        "rows": [],
    }
    weights = {name: random_weights(n, k) for name, (n, k) in SHAPES.items()}
    # the same weights in e2m1_asm's pair order, for the variants that read it (once per shape, not per token count)
    pair_weights = ({name: to_pair_order(w[0]) for name, w in weights.items()}
                    if args.variants or args.gluon_variants or args.pairs else {})
    for t in [int(v) for v in args.tokens.split(",")]:
        offsets = uniform_routing(t)
        m = t * TOPK
        counts = (offsets[1:] - offsets[:-1])
        active = int((counts > 0).sum())
        offs_end = offsets[1:].contiguous()
        total = {"fwd": 0.0, "dgrad": 0.0, "fwd_bf16": 0.0, "dgrad_bf16": 0.0, "fwd_dequant": 0.0,
                 "dgrad_dequant": 0.0, "fwd_dequant_serial": 0.0, "dgrad_dequant_serial": 0.0}
        bounds, gsh = offsets.tolist(), None
        for name, (n, k) in SHAPES.items():
            packed, scale, gs, wbf = weights[name]
            pairs = pair_weights.get(name)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16)
            wbytes = active * n * (k // 2 + k // 16)
            floor_ms = wbytes / (copy_tbps * 1e12) * 1e3
            fl = 2.0 * m * n * k
            gsh = gs.tolist()
            cases = [("fwd", "nvfp4", None, None)]
            cases.append(("dgrad", "nvfp4", None, None))
            if gemm.gluon_dgrad_default(dy, m, E):  # the Triton kernel the Gluon default replaced, beside it
                cases.append(("dgrad", "nvfp4[triton]", gemm.dgrad_config(m, E), None))
            if t >= 2048:  # decode once to bf16 + cuBLAS per expert (gs as alpha), with and without overlap
                for direction in ("fwd", "dgrad"):
                    cases.append((direction, "dequant", None, "dequant"))
                    cases.append((direction, "dequant_serial", None, "dequant_serial"))
            if args.variants:  # the integer-field decoder (Triton 3.8 keeps its tile out of shared memory)
                cases.append(("fwd", "nvfp4[triton decoder]", None, "triton"))
                cases.append(("dgrad", "nvfp4[triton decoder]", None, "triton"))
            if args.variants and t <= 512:  # few rows per expert: bound by decoding the weights
                for label, cfg in (("BN=64", dict(BN=64, num_warps=4)), ("BN=256,8w", dict(BN=256, num_warps=8)),
                                   ("BK=256", dict(BK=256, num_stages=3)), ("stages=2", dict(num_stages=2)),
                                   ("stages=6", dict(num_stages=6)), ("8 warps", dict(num_warps=8))):
                    cases.append(("fwd", f"nvfp4[{label}]", cfg, None))
                cases.append(("dgrad", "nvfp4[dgrad BN=64]", dict(BN=64), None))
                cases.append(("dgrad", "nvfp4[dgrad BK=64]", dict(BK=64), None))
            if args.variants and t >= 4096:
                cases.append(("fwd", "nvfp4[BM=256]", dict(BM=256, BN=128, BK=128, num_warps=8, num_stages=3), None))
                cases.append(("fwd", "nvfp4[BK=64,4st]", dict(BM=128, BN=128, BK=64, num_warps=8, num_stages=4), None))
                cases.append(("dgrad", "nvfp4[BN=64]", dict(BM=128, BK=128, BN=64, num_warps=8, num_stages=3, SWAP=False), None))
                cases.append(("dgrad", "nvfp4[BM=256,BN=64]",
                              dict(BM=256, BK=128, BN=64, num_warps=8, num_stages=3, SWAP=False), None))
                cases.append(("dgrad", "nvfp4[BM=256,st2]",
                              dict(BM=256, BK=128, BN=128, num_warps=8, num_stages=2, SWAP=False), None))
            if (args.variants or args.gluon_variants) and t >= 4096:
                # the warp-specialized Gluon kernel (quant/kernels/nvfp4_moe_gluon.py)
                for label, cfg in GLUON_VARIANTS:
                    for direction in ("fwd", "dgrad"):
                        cases.append((direction, f"nvfp4[gluon {label}]", dict(GLUON=True, **cfg), None))
            if args.pairs or ((args.variants or args.gluon_variants) and t >= 4096):
                # the Triton kernels with the pair-order decoder, and the Gluon default with PAIRS where it runs
                cases.append(("fwd", "nvfp4[triton pairs]", None, "pairs"))
                cases.append(("dgrad", "nvfp4[triton pairs]", gemm.dgrad_config(m, E), "pairs"))
                if gemm.gluon_dgrad_default(dy, m, E):
                    cases.append(("dgrad", "nvfp4[gluon default PAIRS]", dict(gemm.GLUON_DGRAD_CONFIG, PAIRS=True),
                                  None))
            if args.variants and t >= 4096:
                for bm, bn, nw, ns in ((64, 64, 4, 4), (128, 64, 8, 3), (128, 128, 8, 3), (256, 64, 8, 3)):
                    cases.append(("dgrad", f"nvfp4[SWAP BM={bm},BN={bn}]",
                                  dict(BM=bm, BK=128, BN=bn, num_warps=nw, num_stages=ns, SWAP=True), None))
            base = {}
            for direction in ("fwd", "dgrad"):
                if direction == "fwd":
                    fn, kind, _ = grouped_mm_fn(x, wbf, offs_end, transpose=True)
                    act = m * k * 2 + m * n * 2
                else:
                    fn, kind, _ = grouped_mm_fn(dy, wbf, offs_end, transpose=False)
                    act = m * n * 2 + m * k * 2
                ms = bench(fn, args.rep_ms)
                base[direction] = ms
                total[direction + "_bf16"] += ms
                bf_bytes = active * n * k * 2 + act
                res["rows"].append(dict(
                    tokens=t, routed_rows=m, gemm=name, direction=direction, impl=f"bf16 {kind}",
                    median_ms=round(ms, 4), tflops=round(fl / ms / 1e9, 1), gbps=round(bf_bytes / ms / 1e6, 1),
                ))
            for direction, label, cfg, dec in cases:
                w = pairs if (cfg or {}).get("PAIRS") or dec == "pairs" else packed  # the order the decoder reads
                if dec in ("dequant", "dequant_serial"):
                    ov = dec == "dequant"
                    if direction == "fwd":
                        fn = (lambda ov=ov: nd.dequant_fwd(x, packed, scale, gsh, bounds, overlap=ov))
                        act = m * k * 2 + m * n * 2
                    else:
                        fn = (lambda ov=ov: nd.dequant_dgrad(dy, packed, scale, gsh, bounds, overlap=ov))
                        act = m * n * 2 + m * k * 2
                elif direction == "fwd":
                    fn = (lambda cfg=cfg, dec=dec, w=w:
                          gemm.launch_fwd(x, w, scale, gs, offsets, config=cfg, decoder=dec))
                    act = m * k * 2 + m * n * 2
                else:
                    fn = (lambda cfg=cfg, dec=dec, w=w:
                          gemm.launch_dgrad(dy, w, scale, gs, offsets, config=cfg, decoder=dec))
                    act = m * n * 2 + m * k * 2
                try:
                    fn()
                    torch.cuda.synchronize()
                    ms = bench(fn, args.rep_ms)
                except Exception as exc:  # noqa: BLE001
                    res["rows"].append(dict(tokens=t, gemm=name, direction=direction, impl=label,
                                            error=f"{type(exc).__name__}: {str(exc)[:300]}"))
                    print("ERROR", t, name, direction, label, exc, flush=True)
                    continue
                if cfg is None and dec is None:
                    total[direction] += ms
                if dec in ("dequant", "dequant_serial"):
                    total[f"{direction}_{dec}"] += ms
                cfg_used = dict(gemm.fwd_config(m, E) if direction == "fwd" else gemm.dgrad_config(m, E), **(cfg or {}))
                res["rows"].append(dict(
                    tokens=t, routed_rows=m, gemm=name, direction=direction, impl=label, config=cfg_used,
                    active_experts=active, median_ms=round(ms, 4), tflops=round(fl / ms / 1e9, 1),
                    gbps=round((wbytes + act) / ms / 1e6, 1), bf16_ms=round(base[direction], 4),
                    speedup_vs_bf16=round(base[direction] / ms, 3), weight_floor_ms=round(floor_ms, 4),
                    time_over_weight_floor=round(ms / floor_ms, 2),
                ))
                print(f"T={t:6d} {name:8s} {direction:5s} {label:24s} {ms:8.3f} ms  {fl / ms / 1e9:6.1f} TF/s  "
                      f"bf16 {base[direction]:8.3f} ms  x{base[direction] / ms:5.2f}  floor x{ms / floor_ms:5.2f}",
                      flush=True)
            del x, dy
        gluon = gemm.gluon_dgrad_device(packed)
        auto = {d: total[f"{d}_dequant"] if t >= 2048 and moe._pick(None, m, E, d, gluon) == "dequant" else total[d]
                for d in ("fwd", "dgrad")}
        res.setdefault("totals", []).append(dict(
            tokens=t, auto_fwd_ms=round(auto["fwd"], 4), auto_dgrad_ms=round(auto["dgrad"], 4),
            auto_fwd_vs_bf16=round(total["fwd_bf16"] / auto["fwd"], 3),
            auto_dgrad_vs_bf16=round(total["dgrad_bf16"] / auto["dgrad"], 3),
            dequant_fwd_ms=round(total["fwd_dequant"], 4), dequant_dgrad_ms=round(total["dgrad_dequant"], 4),
            dequant_serial_fwd_ms=round(total["fwd_dequant_serial"], 4),
            dequant_serial_dgrad_ms=round(total["dgrad_dequant_serial"], 4),
            expert_fwd_ms=round(total["fwd"], 4), expert_fwd_bf16_ms=round(total["fwd_bf16"], 4),
            input_grad_ms=round(total["dgrad"], 4), input_grad_bf16_ms=round(total["dgrad_bf16"], 4),
            input_grad_ratio_vs_bf16=round(total["dgrad_bf16"] / total["dgrad"], 3) if total["dgrad"] else None,
            target_fwd_ms=1.5 if t <= 512 else (28.0 if t == 32768 else None),
        ))
        print(f"T={t}: expert fwd (gate_up+down) {total['fwd']:.3f} ms (bf16 {total['fwd_bf16']:.3f}); "
              f"input grad {total['dgrad']:.3f} ms (bf16 {total['dgrad_bf16']:.3f})", flush=True)
    if args.lora_tokens:
        res["lora"] = bench_lora(args.lora_tokens, args.lora_loop, args.rep_ms)
    res["finished"] = time.strftime("%Y-%m-%d %H:%M:%S")
    text = json.dumps(res, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text + "\n")
    print(json.dumps(res["totals"], indent=1))


if __name__ == "__main__":
    main()
