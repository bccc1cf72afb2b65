"""Benchmark the NVFP4 weight decode alone (``quant.kernels.nvfp4_dequant.launch_decode``): what the decode + cuBLAS
path of the routed experts pays once per chunk of experts, forward and recompute, at M3's shapes (chunks of 8
experts, gate_up [6144, 6144] and down [6144, 3072]; one expert alone).

Per shape and variant: median ms and TB/s over the bytes moved (0.5625 B read + 2 B written per weight), beside
two memory-bound references on the same device in the same run: a bf16 copy of the decoded size and torch's uint8
-> bf16 conversion of the packed bytes. Variants: the asm decoder at several tiles (ROWS x WARPS), the integer-field
decoder, and with --base DIR the decode of another checkout (``DIR/quant/kernels/nvfp4_dequant.py``, e.g. a
``git archive`` of the commit before), each checked bit for bit against the first variant's output.

    python scripts/bench_nvfp4_decode.py [--base base] --out results/gpu/runNN/bench_decode.json
"""

import argparse
import importlib.util
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from quant.kernels import nvfp4_dequant as nd  # noqa: E402

SHAPES = {"gate_up_x8": (8, 6144, 6144), "down_x8": (8, 6144, 3072), "gate_up_x1": (1, 6144, 6144)}  # (E, N, K)
TILES = ((128, 4), (64, 4), (256, 4), (128, 8), (256, 8))


def bench(fn, rep_ms):
    import triton

    return triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 5), rep=rep_ms, return_mode="median")


def load_base(path: str):
    """nvfp4_dequant of another checkout, imported under its own name; the ``quant`` imports inside it resolve to this
    checkout's package (already imported), which the decode on CUDA tensors does not use beyond quant.forms' names."""
    spec = importlib.util.spec_from_file_location("base_nvfp4_dequant",
                                                  os.path.join(path, "quant", "kernels", "nvfp4_dequant.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", default=None, help="a checkout whose nvfp4_dequantize is timed beside this one's")
    ap.add_argument("--rep-ms", type=int, default=100)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    base = load_base(args.base) if args.base else None
    torch.manual_seed(0)
    rows = []
    for name, (e, n, k) in SHAPES.items():
        packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
        scale = torch.randint(0x28, 0x70, (e, n, k // 16), dtype=torch.uint8, device="cuda")
        out = torch.empty(e, n, k, dtype=torch.bfloat16, device="cuda")
        moved = packed.numel() + scale.numel() + 2 * out.numel()
        variants = [(f"asm {r}x{w}", lambda r=r, w=w: nd.launch_decode(packed, scale, out, rows=r, warps=w))
                    for r, w in TILES]
        variants.append(("fields 128x4", lambda: nd.launch_decode(packed, scale, out, asm=False)))
        if base is not None:
            variants.append(("base", lambda: base.nvfp4_dequantize(packed, scale, out)))
        src = torch.empty_like(out)
        dst = torch.empty_like(out)
        refs = [("copy bf16 (decoded size)", lambda: dst.copy_(src), 4 * out.numel()),
                ("uint8 -> bf16 (packed size)", lambda: packed.to(torch.bfloat16), 3 * packed.numel())]
        first = None
        for label, fn in variants:
            out.fill_(float("nan"))
            fn()
            if first is None:
                first = out.clone()
            same = bool(torch.equal(out.view(torch.int16), first.view(torch.int16)))
            ms = bench(fn, args.rep_ms)
            rows.append(dict(shape=name, variant=label, ms=round(ms, 4), tbps=round(moved / ms / 1e9, 3),
                             bits_equal_first=same))
            print(f"{name:11s} {label:28s} {ms:8.3f} ms {moved / ms / 1e9:6.3f} TB/s  same={same}", flush=True)
        for label, fn, nbytes in refs:
            ms = bench(fn, args.rep_ms)
            rows.append(dict(shape=name, variant=label, ms=round(ms, 4), tbps=round(nbytes / ms / 1e9, 3)))
            print(f"{name:11s} {label:28s} {ms:8.3f} ms {nbytes / ms / 1e9:6.3f} TB/s", flush=True)
        del packed, scale, out, src, dst, first
        torch.cuda.empty_cache()
    result = {"command": " ".join(["python"] + sys.argv), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "rows": rows}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
