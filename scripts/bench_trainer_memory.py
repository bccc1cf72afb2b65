#!/usr/bin/env python
"""Trainer peak memory of one forward+backward of `token_logprobs`: quantized base vs bf16 base.

    python scripts/bench_trainer_memory.py [--device cpu|cuda] [--models tiny,slice] [--slice-experts 128]
        [--bases quantized,bf16,quantized_recompute] [--tokens 256] [--repeats 3] [--slice-repeats N]
        [--threads N] [--mem-limit-gb 16] [--out FILE.json]

Full slice on a GPU (build ~3 min, then about a minute per case): --device cuda --slice-repeats 1. On a 2-core CPU
the full width does not fit in bf16 (~30 GB); results/trainer_memory_cpu.json used --slice-experts 32 --tokens 64
(4-7 min per case).

Models:
- tiny: the m3.tiny checkpoint (hidden 256, 8 experts), trained in bf16.
- slice: an "M3-shaped slice", 2 decoder layers at full MiniMax-M3 width (hidden 6144, 64 q / 4 KV heads of 128,
  `--slice-experts` experts top-4 of intermediate 3072, MSA with 4 index heads of 128 and top-16 blocks, vocab cut
  to 4096), both layers MoE + sparse attention as 57 of M3's 60 are. It is written once to cache/ as a served
  checkpoint: random bf16 weights quantized one module at a time (NVFP4 experts with a shared w1/w3 global scale,
  MXFP8 projections; quant.convert's plan), so no bf16 copy of all experts ever exists.
  The bf16 base is the same checkpoint dequantized on load.

Bases: "quantized" (what the trainer serves from), "bf16", and (only when named in --bases) "quantized_recompute",
a what-if that is not the trainer's code: the same quantized base with every dequantize+GEMM wrapped in activation checkpointing, so the
bf16 weight it materializes is rebuilt in backward instead of being kept by autograd. (On CUDA with bf16 the MoE
runs grouped NVFP4 kernels that already keep only packed weights; the what-if then changes the MXFP8 projections.)

Each measurement runs in a fresh subprocess. CPU: peak RSS (VmHWM, reset through /proc/self/clear_refs just
before the step, so model loading does not count), and the process baseline after imports; parameters and
buffers are first copied out of the safetensors mmaps they view (see detach_from_files); a watchdog kills a case
whose anonymous RSS passes `--mem-limit-gb`, before the OOM killer would pick a process. CUDA:
torch.cuda.max_memory_allocated over the step (peak statistics reset just before it). Reported: medians over
`--repeats` subprocesses (the last of `--steps` steps in each).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without install

GB = 1e9
BASES = ("quantized", "bf16", "quantized_recompute")
SLICE = dict(vocab_size=4096, hidden_size=6144, num_hidden_layers=2, num_attention_heads=64, num_key_value_heads=4,
             head_dim=128, intermediate_size=3072, dense_intermediate_size=12288, num_experts_per_tok=4,
             rotary_dim=64, moe_layer_freq=[1, 1], sparse_attention_freq=[1, 1], sparse_topk_blocks=16,
             sparse_num_index_heads=4, sparse_index_dim=128)
SLICE_VERSION = 1  # bump when the slice recipe changes (invalidates cache/)


# --- the slice checkpoint -----------------------------------------------------------------------------------------
def slice_text_config(experts: int) -> dict:
    from m3.config import resolve_text_config, validate_config

    t = resolve_text_config(**SLICE, num_local_experts=experts)
    validate_config(t)
    return t


def slice_dir(experts: int) -> Path:
    key = json.dumps({"v": SLICE_VERSION, "t": slice_text_config(experts)}, sort_keys=True)
    return ROOT / "cache" / "bench" / f"m3slice-e{experts}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def build_slice(experts: int, device: str = "cpu", seed: int = 0) -> Path:
    """Write the slice checkpoint (idempotent: a complete one is reused). Weights are drawn per tensor name as
    m3.weights draws them, so the first experts of a wider slice equal a narrower slice's."""
    import torch

    from m3.weights import weight_specs
    from quant import convert as qc
    from quant.checkpoint import CheckpointWriter, QuantizedCheckpoint, mixed_precision_config  # noqa: I001
    from quant.checkpoint import nvfp4_global_scale, quantize_mxfp8, quantize_nvfp4

    out = slice_dir(experts)
    if (out / "DONE").is_file():
        return out
    t = slice_text_config(experts)
    specs = weight_specs(t)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)

    def draw(key):  # m3.weights.init_weights' recipe: one generator per tensor name
        shape, std, fp32 = specs[key]
        name_seed = int.from_bytes(hashlib.sha256(f"{seed}/{key}".encode()).digest()[:8], "little")
        w = torch.randn(shape, generator=torch.Generator().manual_seed(name_seed >> 1)) * std
        return w if fp32 else w.to(torch.bfloat16)

    algos, done = {}, set()
    with CheckpointWriter(tmp, max_shard_bytes=1 << 30) as writer:
        for name in specs:
            prefix = name.removesuffix(".weight")
            algo = qc.plan(prefix) if name.endswith(".weight") else None
            if algo is None:
                writer.add(name, draw(name))
            elif algo == qc.LINEAR_ALGO:
                writer.add_module(prefix, quantize_mxfp8(draw(name).to(device).float(), name=name))
            elif prefix not in done:  # an expert: quantize w1/w3 together (shared global scale), then w2
                base = prefix.rsplit(".", 1)[0]
                group = [f"{base}.w1", f"{base}.w3"] if prefix.endswith(("w1", "w3")) else [prefix]
                ws = {p: draw(f"{p}.weight").to(device) for p in group}
                gs = nvfp4_global_scale(*ws.values())
                for p, w in ws.items():
                    writer.add_module(p, quantize_nvfp4(w.float(), gs, name=p))
                done.update(group)
            if algo is not None:
                algos[prefix] = algo
    config = {"architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3_vl", "dtype": "bfloat16",
              "tie_word_embeddings": False, "text_config": {**t, "dtype": "bfloat16"},
              "quantization_config": mixed_precision_config(algos, qc.IGNORE)}
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    QuantizedCheckpoint(tmp)  # the layout must pass the reader's checks
    (tmp / "DONE").write_text("")
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def estimate_gb(t: dict, base: str, tokens: int, grouped: bool = False) -> dict:
    """Rough bytes of the frozen base and of what one step keeps alive, to skip cases that cannot fit.
    grouped: the CUDA bf16 MoE path (grouped NVFP4 kernels), which keeps no dequantized expert weight."""
    h, layers, e, i = t["hidden_size"], t["num_hidden_layers"], t["num_local_experts"], t["intermediate_size"]
    s = t["sparse_attention_config"]
    q, kv = t["num_attention_heads"] * t["head_dim"], t["num_key_value_heads"] * t["head_dim"]
    idx = s["sparse_num_index_heads"] * s["sparse_index_dim"] + s["sparse_index_dim"]
    expert = e * 3 * h * i * layers
    linear = ((2 * q + 2 * kv + idx) * h + 3 * h * t["shared_intermediate_size"]) * layers
    other = 2 * t["vocab_size"] * h * 2
    lora = 2 * 4 * 32 * e * (2 * h + 3 * i) * layers  # fp32 expert LoRA r32 and its gradient, both bases alike
    used = min(1.0, tokens * t["num_experts_per_tok"] / e)  # experts a step touches (upper bound)
    if base == "bf16":
        resident, step = 2 * (expert + linear) + other + lora / 2, lora / 2
        load = resident + 2 * expert / layers  # torch.stack of the per-expert list of one layer
    else:
        resident = 0.5625 * expert + 1.03 * linear + other + lora / 2
        load = resident + 0.5625 * expert / layers
        # autograd keeps each dequantized bf16 weight until backward, unless it is recomputed
        kept = 0 if base == "quantized_recompute" else 2 * ((0 if grouped else expert * used) + linear)
        step = lora / 2 + kept
    return {"resident": resident / GB, "load": load / GB, "step": (resident + step) / GB}


# --- one measurement (subprocess) ---------------------------------------------------------------------------------
def _status_kb(key: str, pid: int | str = "self") -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1])
    except FileNotFoundError:  # the worker just exited
        return 0
    if pid != "self":  # an exited worker (zombie) has no memory lines
        return 0
    raise KeyError(key)


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def detach_from_files(model) -> None:
    """Copy every parameter/buffer into memory of its own. A tensor read through QuantizedCheckpoint views the
    safetensors mmap of its whole shard (the model keeps such views: norms, embeddings, router, whenever `.to` is a
    no-op), and those file pages count in RSS; copied, the RSS is the memory the model really needs."""
    import torch

    with torch.no_grad():
        for module in model.modules():
            for name, p in module._parameters.items():
                if p is not None:
                    p.data = p.data.clone()
            for name, b in module._buffers.items():
                if b is not None:
                    module._buffers[name] = b.clone()


def recompute_dequantized_weights() -> None:
    """The what-if: rebuild each dequantized weight in backward instead of keeping it (checkpoint per GEMM). On
    CUDA the bf16 MoE already runs the grouped NVFP4 kernels (rl.model.transformer.MoE._grouped), which keep only the packed
    weights; there this changes the MXFP8 projections alone."""
    import torch
    from torch.utils.checkpoint import checkpoint

    from quant.serving import MXFP8Linear
    from rl.model.quantized_base import ExpertWeights

    expert, fwd = ExpertWeights._expert_linear, MXFP8Linear.forward

    def expert_linear(self, name, x, e):
        if not (self.quantized and torch.is_grad_enabled()):
            return expert(self, name, x, e)
        return checkpoint(expert, self, name, x, e, use_reentrant=False)

    def linear_forward(self, x):
        return checkpoint(fwd, self, x, use_reentrant=False) if torch.is_grad_enabled() else fwd(self, x)

    ExpertWeights._expert_linear, MXFP8Linear.forward = expert_linear, linear_forward


def measure(spec: dict) -> dict:
    import torch

    torch.set_num_threads(spec["threads"])
    from rl.model import M3ForTraining, TrainerModelConfig
    from rl.model.lora import lora_parameters

    cuda = spec["device"] == "cuda"
    out = {"baseline_rss_gb": _status_kb("VmRSS") * 1024 / GB}
    base = "quantized" if spec["base"] == "quantized_recompute" else spec["base"]
    if spec["base"] == "quantized_recompute":
        recompute_dequantized_weights()
    t0 = time.perf_counter()
    model = M3ForTraining(TrainerModelConfig(path=spec["path"], dtype=spec["dtype"], base=base))
    if cuda:
        model.to("cuda")
        torch.cuda.synchronize()
    out["load_s"] = time.perf_counter() - t0
    out["load_peak_rss_gb"] = _status_kb("VmHWM") * 1024 / GB
    if not cuda:
        out["rss_before_detach_gb"] = _status_kb("VmRSS") * 1024 / GB
        detach_from_files(model)
    out["resident_rss_gb"] = _status_kb("VmRSS") * 1024 / GB
    tensors = list(model.parameters()) + list(model.buffers())
    out["state_gb"] = sum(t.numel() * t.element_size() for t in tensors) / GB
    out["lora_gb"] = sum(p.numel() * p.element_size() for p in lora_parameters(model)) / GB
    if cuda:
        out["resident_cuda_gb"] = torch.cuda.memory_allocated() / GB
    g = torch.Generator().manual_seed(0)
    n, vocab = spec["tokens"], model.config.vocab_size
    dev = "cuda" if cuda else "cpu"
    ids = torch.randint(0, vocab, (n,), generator=g).to(dev)
    targets = torch.randint(0, vocab, (n,), generator=g).to(dev)
    cu = torch.tensor([0, n // 2, n], device=dev)  # two packed sequences
    peaks, seconds = [], []
    for _ in range(spec["steps"]):
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        elif not _reset_peak_rss():
            raise RuntimeError("/proc/self/clear_refs is not writable: cannot isolate the step's peak RSS")
        t0 = time.perf_counter()
        (-model.token_logprobs(ids, cu, targets).mean()).backward()
        if cuda:
            torch.cuda.synchronize()
            peaks.append(torch.cuda.max_memory_allocated() / GB)
        else:
            peaks.append(_status_kb("VmHWM") * 1024 / GB)
        seconds.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    out.update(step_peak_gb=peaks[-1], step_peaks_gb=peaks, step_s=seconds[-1])
    if cuda:
        out["step_max_reserved_gb"] = torch.cuda.max_memory_reserved() / GB
    return out


def run_case(spec: dict, limit_gb: float | None, timeout_s: float) -> dict:
    """One fresh worker. On CPU a watchdog kills it once its anonymous RSS passes `limit_gb` (an rlimit cannot be
    used: safetensors maps whole shards writable-private, which counts as data and address space)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    env = dict(os.environ)
    if spec["device"] == "cpu":  # see the notes in the report
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 << 20))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            stdout, stderr = p.communicate(timeout=0.2)
            break
        except subprocess.TimeoutExpired:
            pass
        anon = _status_kb("RssAnon", p.pid) * 1024 / GB if limit_gb else 0
        if anon > (limit_gb or math.inf) or time.monotonic() > deadline:
            why = f"anonymous RSS {anon:.1f} GB > limit {limit_gb:.1f} GB" if anon > (limit_gb or math.inf) \
                else f"timed out after {timeout_s:.0f} s"
            p.kill()  # only the worker started above
            p.communicate()
            return {"error": why}
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if p.returncode or not lines:
        tail = (stderr or stdout).strip().splitlines()[-3:]
        return {"error": f"exit {p.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


# --- driver -------------------------------------------------------------------------------------------------------
def _median(runs: list[dict], key: str):
    vals = [r[key] for r in runs if key in r]
    return round(statistics.median(vals), 4) if vals else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--models", default="tiny,slice", help="comma list of tiny, slice")
    ap.add_argument("--bases", default="quantized,bf16", help=f"comma list of {', '.join(BASES)}")
    ap.add_argument("--slice-experts", type=int, default=128, help="routed experts per slice layer (M3: 128)")
    ap.add_argument("--tokens", type=int, default=256, help="tokens per step (two packed sequences)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeats", type=int, default=3, help="fresh subprocesses per case (median)")
    ap.add_argument("--slice-repeats", type=int, default=None, help="repeats for the slice (default --repeats)")
    ap.add_argument("--steps", type=int, default=1, help="steps per subprocess (the last one is reported)")
    ap.add_argument("--threads", type=int, default=max(1, min(8, os.cpu_count() or 1)))
    ap.add_argument("--mem-limit-gb", type=float, default=None,
                    help="CPU: anonymous-RSS limit per case (the worker is killed above it); cases estimated above it "
                         "are skipped (default: 70%% of MemAvailable)")
    ap.add_argument("--timeout-s", type=float, default=3600)
    ap.add_argument("--out", default=None, help="JSON output (default results/trainer_memory_<device>.json)")
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(json.loads(args.worker))), flush=True)
        return 0

    import torch

    from m3.tiny import ensure_tiny_model

    command = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(__file__, ROOT), *sys.argv[1:]])
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: CUDA is not available")
    limit = args.mem_limit_gb
    slice_repeats = args.repeats if args.slice_repeats is None else args.slice_repeats
    if limit is None and args.device == "cpu":
        limit = 0.7 * _meminfo_kb("MemAvailable") * 1024 / GB
    report = {"command": command, "device": args.device, "host": _host(args.device), "settings": {
        "tokens": args.tokens, "dtype": args.dtype, "repeats": args.repeats, "slice_repeats": slice_repeats,
        "steps": args.steps,
        "threads": args.threads, "mem_limit_gb": limit and round(limit, 1), "slice_experts": args.slice_experts},
        "notes": [], "ratios": {}, "cases": {}, "not_measured": {}}
    metric = "step_peak_gb"
    grouped = args.device == "cuda" and args.dtype == "bfloat16"  # rl.model.transformer.MoE takes the grouped kernels then
    report["notes"] = [
        "step_peak_gb: " + ("max_memory_allocated over one forward+backward (weights, LoRA and its gradients "
                            "included)" if args.device == "cuda" else
                            "peak RSS of the worker over one forward+backward (VmHWM reset before the step; "
                            "includes the Python/torch runtime, baseline_rss_gb)"),
        "MoE path: " + ("grouped NVFP4 kernels (quant.kernels)" if grouped else "per-expert loop (quant.serving)")
        + "; the quantized base keeps only packed bytes for backward and rebuilds each dequantized weight there "
        "(quant.serving since 9e5c6fa; before, autograd kept every used expert's and projection's bf16 weight)",
        "quantized_recompute (what-if, only with --bases): activation checkpointing around each dequantize+GEMM",
        "CPU workers run with MALLOC_MMAP_THRESHOLD_=1 MiB: otherwise glibc keeps the freed 0.1-32 MB blocks of "
        "the per-weight dequantization in its heap and RSS reports that cache, not live tensors",
        "ratios: quantized base / bf16 base of step_peak_gb; step_peak_above_baseline subtracts the runtime "
        "baseline first; state = bytes of parameters + buffers",
    ]
    for model in args.models.split(","):
        if model == "tiny":
            path, t = str(ensure_tiny_model(dtype="bfloat16").vllm), None
        elif model == "slice":
            t = slice_text_config(args.slice_experts)
            t0 = time.perf_counter()
            path = str(build_slice(args.slice_experts, args.device))
            report.setdefault("slice_build_s", round(time.perf_counter() - t0, 1))
        else:
            ap.error(f"--models: unknown model {model!r}")
        name = model if model == "tiny" else f"slice_e{args.slice_experts}"
        for base in args.bases.split(","):
            if base not in BASES:
                ap.error(f"--bases: unknown base {base!r}")
            key = f"{name}/{base}"
            est = estimate_gb(t, base, args.tokens, grouped) if t else None
            if est and args.device == "cpu" and max(est["load"], est["step"]) > limit:
                report["not_measured"][key] = (f"estimated {max(est['load'], est['step']):.1f} GB (load "
                                               f"{est['load']:.1f}, step {est['step']:.1f}) > limit {limit:.1f} GB")
                print(key, "skipped:", report["not_measured"][key], flush=True)
                continue
            spec = {"path": path, "base": base, "dtype": args.dtype, "device": args.device, "tokens": args.tokens,
                    "steps": args.steps, "threads": args.threads}
            runs = []
            for _ in range(args.repeats if model == "tiny" else slice_repeats):
                r = run_case(spec, limit if args.device == "cpu" else None, args.timeout_s)
                print(key, json.dumps(r), flush=True)
                if "error" in r:
                    report["not_measured"][key] = r["error"]
                    break
                runs.append(r)
            if runs:
                keys = [k for k in runs[0] if not isinstance(runs[0][k], list)]
                report["cases"][key] = {"runs": len(runs), **{k: _median(runs, k) for k in keys}}
                if est:
                    report["cases"][key]["estimate_gb"] = {k: round(v, 2) for k, v in est.items()}
        for q in ("quantized", "quantized_recompute"):
            a, b = report["cases"].get(f"{name}/{q}"), report["cases"].get(f"{name}/bf16")
            if a and b:
                r = {"step_peak": round(a[metric] / b[metric], 3)}
                if "baseline_rss_gb" in a:  # CPU: the Python/torch runtime is in both peaks; also without it
                    r["step_peak_above_baseline"] = round((a[metric] - a["baseline_rss_gb"])
                                                          / (b[metric] - b["baseline_rss_gb"]), 3)
                r["state"] = round(a["state_gb"] / b["state_gb"], 3)
                report["ratios"][f"{name}: {q} / bf16"] = r
    if "slice" in args.models.split(",") and args.slice_experts != 128:
        full = slice_text_config(128)
        for base in args.bases.split(","):
            here, gpu = estimate_gb(full, base, args.tokens, grouped), estimate_gb(full, base, args.tokens, True)
            report["not_measured"][f"slice_e128/{base}"] = (
                f"not run (--slice-experts {args.slice_experts}); estimated here: load {here['load']:.1f} GB, step "
                f"peak {here['step']:.1f} GB; on CUDA (grouped experts): step peak {gpu['step']:.1f} GB; run "
                "--slice-experts 128 --device cuda")
    out = Path(args.out or ROOT / "results" / f"trainer_memory_{args.device}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report["ratios"], indent=2))
    print("wrote", out)
    return 0


def _meminfo_kb(key: str) -> int:
    for line in open("/proc/meminfo"):
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def _host(device: str) -> dict:
    import torch

    info = {"cpus": os.cpu_count(), "mem_total_gb": round(_meminfo_kb("MemTotal") * 1024 / GB, 1),
            "python": platform.python_version(), "torch": torch.__version__}
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


if __name__ == "__main__":
    sys.exit(main())
