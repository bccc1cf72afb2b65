"""Benchmark the NVFP4 weight decode alone (``quant.kernels.nvfp4_dequant.launch_decode``): what the decode + cuBLAS
path of the routed experts pays once per chunk of experts, forward and recompute, at M3's shapes (chunks of 8
experts, gate_up [6144, 6144] and down [6144, 3072]; one expert alone).

Per shape and variant: median ms and TB/s over the bytes moved (0.5625 B read + 2 B written per weight), beside
two memory-bound references on the same device in the same run: a bf16 copy of the decoded size and torch's uint8
-> bf16 conversion of the packed bytes. Variants: the asm decoder at several tiles (ROWS x WARPS), the integer-field
decoder, and with --base DIR the decode of another checkout (``DIR/quant/kernels/nvfp4_dequant.py``, e.g. a
``git archive`` of the commit before), each checked bit for bit against the first variant's output.

For the default tile it also splits the time into host and GPU: the host time to enqueue one launch (the GPU idle
first, so no launch waits on a full queue) and the decode kernel's own time in a torch profile; ``--dump DIR`` writes
each compiled decode kernel's metadata, PTX and sm_90 SASS (to compare one Triton's codegen with another's, e.g. the
3.6 and 3.8 of run129; a device call returns 8 files: tar the folder).

    python scripts/bench_nvfp4_decode.py [--base base] [--dump DIR] --out results/gpu/runNN/bench_decode.json
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from quant.kernels import nvfp4_dequant as nd  # noqa: E402

SHAPES = {"gate_up_x8": (8, 6144, 6144), "down_x8": (8, 6144, 3072), "gate_up_x1": (1, 6144, 6144)}  # (E, N, K)
TILES = ((128, 4), (64, 4), (256, 4), (128, 8), (256, 8))


def bench(fn, rep_ms):
    import triton

    return triton.testing.do_bench(fn, warmup=max(rep_ms // 4, 5), rep=rep_ms, return_mode="median")


def host_and_kernel_ms(fn, launches=20):
    """(median host ms to enqueue one launch of fn, median GPU ms of its kernels in a torch profile)."""
    host = []
    for _ in range(launches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t0) * 1e3)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(launches):
            fn()
        torch.cuda.synchronize()
    # device_time_total is in microseconds; one decode kernel per launch
    kernels = [e.device_time_total / 1e3 for e in prof.events() if "dequant" in e.name]
    return statistics.median(host), statistics.median(kernels) if kernels else None


def dump_kernels(kernel, folder: str):
    """Each compiled variant of the decode kernel: its cache key and metadata as JSON, its PTX and SASS."""
    import triton

    os.makedirs(folder, exist_ok=True)
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    index = []
    for cache in [c[0] for c in kernel.device_caches.values()]:
        for key, compiled in cache.items():
            name = f"decode_{len(index)}"
            with open(os.path.join(folder, name + ".ptx"), "w") as f:
                f.write(compiled.asm["ptx"])
            with open(os.path.join(folder, name + ".cubin"), "wb") as f:
                f.write(compiled.asm["cubin"])
            sass = subprocess.run([tool, "-sass", os.path.join(folder, name + ".cubin")], capture_output=True,
                                  text=True).stdout if os.path.exists(tool) else ""
            with open(os.path.join(folder, name + ".sass"), "w") as f:
                f.write(sass)
            meta = {k: v for k, v in compiled.metadata._asdict().items() if isinstance(v, (int, float, str, bool))}
            index.append(dict(name=name, key=str(key), n_regs=compiled.n_regs, n_spills=compiled.n_spills,
                              metadata=meta, sass_instructions=sass.count(";\n") if sass else None))
    with open(os.path.join(folder, "kernels.json"), "w") as f:
        json.dump(index, f, indent=1)


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
    ap.add_argument("--dump", default=None, help="a folder for each compiled decode kernel's PTX, SASS and metadata")
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
            if label == f"asm {nd.ROWS}x{nd.WARPS}":
                host_ms, kernel_ms = host_and_kernel_ms(fn)
                rows[-1].update(host_ms_per_launch=round(host_ms, 4), kernel_ms=kernel_ms and round(kernel_ms, 4))
                print(f"{name:11s} {label:28s} host {host_ms:8.3f} ms per launch, kernel {kernel_ms} ms", flush=True)
        for label, fn, nbytes in refs:
            ms = bench(fn, args.rep_ms)
            rows.append(dict(shape=name, variant=label, ms=round(ms, 4), tbps=round(nbytes / ms / 1e9, 3)))
            print(f"{name:11s} {label:28s} {ms:8.3f} ms {nbytes / ms / 1e9:6.3f} TB/s", flush=True)
        del packed, scale, out, src, dst, first
        torch.cuda.empty_cache()
    import triton

    result = {"command": " ".join(["python"] + sys.argv), "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "triton": triton.__version__, "rows": rows}
    if args.dump:
        dump_kernels(nd._kernel()[1], args.dump)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
