#!/usr/bin/env python
"""Trainer steps of MiniMax-M3 at real width (and depth) under torchrun: FSDP2 over a synthetic served-format base
(NVFP4 routed experts, MXFP8 projections, drawn in memory on each GPU: rl.model.synthetic_base), rank-32 LoRA on every
target, a token-level policy-gradient loss, AdamW on the LoRA parameters.

    # full size (60 layers, 128 experts, vocab 200064), 8 GPUs, 8 x 16K tokens per step:
    torchrun --nproc-per-node 8 scripts/train_step_m3.py --seq-len 16384 --seqs-per-rank 1 --out m3_x8.json
    # one H200, reduced depth (the last 2 of M3's layers: MoE + MSA), quantized vs bf16 base:
    torchrun --nproc-per-node 1 scripts/train_step_m3.py --layers 2 --seqs-per-rank 8 --base quantized
    # CPU smoke test (gloo): --device cpu --override '{"hidden_size": 256, ...}'

The shapes come from recipes/minimax_m3_text_config.json (vLLM's MiniMaxM3TextConfig defaults, which are the
MiniMax-M3 checkpoint's text_config); `--layers N` keeps the last N layers of its layer pattern. Every rank draws the
same weights (seed) and keeps its FSDP2 shard; `--shard-base` (default) shards the packed base too (rl/model/fsdp.py).
Per rank the report holds the peak CUDA memory (allocated and reserved) over the timed steps, the local bytes of the
base and of LoRA, and the step times; rank 0 writes one JSON document (stdout, and --out), "command" first.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gpu_idle  # noqa: E402  (scripts/, this file's folder)
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from rl.model.options import Base  # noqa: E402

CONFIG = ROOT / "recipes" / "minimax_m3_text_config.json"
GB = 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=str(CONFIG), help="JSON with a text_config (MiniMax-M3 shapes)")
    p.add_argument("--layers", type=int, default=None, help="keep the last N layers (default: all)")
    p.add_argument("--override", default="{}", help="JSON dict of text_config overrides (e.g. small CPU shapes)")
    p.add_argument("--seq-len", type=int, default=16384)
    p.add_argument("--seqs-per-rank", type=int, default=1)
    p.add_argument("--steps", type=int, default=3, help="timed steps (after --warmup-steps)")
    p.add_argument("--warmup-steps", type=int, default=1, help="untimed first steps (kernel compilation)")
    p.add_argument("--base", choices=[b.value for b in Base], default=Base.quantized.value)
    p.add_argument("--shard-base", type=int, choices=(0, 1), default=1, help="FSDP2-shard the frozen base")
    p.add_argument("--activation-checkpointing", type=int, choices=(0, 1), default=1)
    p.add_argument("--moe-chunk-tokens", type=int, default=0, help="model.moe_chunk_tokens (0: off)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gc-freeze", type=int, choices=(0, 1), default=1,
                   help="freeze the Python heap after the build, as rl.train does before its steps (0: the cyclic "
                        "collector's full passes scan it, ~0.2 s each at steps of their own choosing)")
    p.add_argument("--profile", type=int, choices=(0, 1), default=0,
                   help="one more step under torch.profiler: GPU time split into expert / attention / projections / "
                        "LM head / other (forward, recompute and backward together)")
    p.add_argument("--trace", default=None, help="with --profile 1: the profiled step's Chrome trace to this .json.gz")
    p.add_argument("--memory-peak", type=int, choices=(0, 1), default=0,
                   help="CUDA: one more, untimed step under torch's allocator history; the blocks live at its peak "
                        "by allocation site (scripts/cuda_memory_peak.py) go to ranks[].memory_at_peak")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    if args.trace and not args.profile:
        p.error("--trace writes the profiled step's trace: it needs --profile 1")
    return args


def text_config(args) -> dict:
    from m3.config import DEFAULT_TEXT_CONFIG, DERIVED_KEYS, SPARSE_DEFAULTS, resolve_text_config, validate_config

    raw = json.loads(Path(args.config).read_text())
    raw = dict(raw.get("text_config", raw))
    raw["num_mtp_modules"] = 0  # the trainer has no MTP head
    override = json.loads(args.override)
    sparse = {**(raw.pop("sparse_attention_config", None) or {}), **override.pop("sparse_attention_config", {})}
    raw.update(override)
    if args.layers is not None:
        raw["num_hidden_layers"] = args.layers
        for key, src in (("moe_layer_freq", raw), ("sparse_attention_freq", sparse)):
            if key in src:
                src[key] = list(src[key])[-args.layers:]
    known = set(DEFAULT_TEXT_CONFIG) | DERIVED_KEYS
    cfg = {k: v for k, v in raw.items() if k in known}
    cfg["sparse_attention_config"] = {k: v for k, v in sparse.items() if k in set(SPARSE_DEFAULTS) | DERIVED_KEYS}
    t = resolve_text_config(**cfg)
    validate_config(t)
    return t


def init_process_group(device: str):
    """torchrun's group; also at world size 1, so the FSDP2 code path is the one multi-GPU runs take."""
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29512")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    dev = torch.device("cuda", local) if device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", rank=rank, world_size=world,
                            device_id=dev if dev.type == "cuda" else None)
    return rank, world, dev


def local_bytes(tensors) -> int:
    from torch.distributed.tensor import DTensor

    return sum((t.to_local() if isinstance(t, DTensor) else t).nbytes for t in tensors)


def build(args, t: dict, device, mesh):
    from rl.model import M3ForTraining, TrainerModelConfig
    from rl.model.fsdp import shard_layer, shard_model
    from rl.model.lora import LoRAConfig, lora_parameters
    from rl.model.quantized_base import BaseWeights
    from rl.model.synthetic_base import SyntheticCheckpoint

    mcfg = TrainerModelConfig(path=SyntheticCheckpoint.path, dtype="bfloat16", base=args.base,
                              activation_checkpointing=bool(args.activation_checkpointing),
                              moe_chunk_tokens=args.moe_chunk_tokens,
                              lora=LoRAConfig(rank=args.lora_rank, alpha=2 * args.lora_rank))
    base = BaseWeights(SyntheticCheckpoint(t, device, args.seed), torch.bfloat16, args.base, "hopper", False, t)
    shard = bool(args.shard_base)
    model = M3ForTraining(mcfg, base=base, on_layer=lambda layer: shard_layer(layer, mesh, shard_base=shard))
    shard_model(model, mesh=mesh, shard_base=shard)
    return model, lora_parameters(model)


def make_batch(args, t, rank, device):
    from rl.batch import PackedBatch

    g = torch.Generator().manual_seed(1000 + rank)
    n, total = args.seq_len, args.seq_len * args.seqs_per_rank
    ids = torch.randint(0, t["vocab_size"], (total + 1,), generator=g)
    mask = torch.zeros(total, dtype=torch.bool)
    for s in range(args.seqs_per_rank):  # the last quarter of each sequence is "response"
        mask[s * n + 3 * n // 4:(s + 1) * n] = True
    cu = torch.arange(0, total + 1, n)
    adv = torch.randn(args.seqs_per_rank, generator=g).sign().repeat_interleave(n)  # one advantage per sequence
    return PackedBatch(ids[:-1], ids[1:], cu, mask, torch.zeros(total), None, None), adv


def step(model, optimizer, batch, token_adv, device, mem=None):
    """One optimizer step. The loss is the token-level REINFORCE form of rl.algorithm's (-A * log pi over response
    tokens, IS weight 1): its cost is nothing next to the model's, and it keeps this launcher free of verl/Hydra,
    which the GPU machines may lack. mem (CUDA): filled with allocated bytes at the step's phases."""
    if mem is not None:
        mem["before_forward"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    saved = {}  # what forward leaves for backward outside the checkpoints (mem only): the largest storages, by op

    def pack(t):
        key = (t.untyped_storage().data_ptr(), t.device)
        op = type(t.grad_fn).__name__ if t.grad_fn is not None else "leaf/input"
        saved.setdefault(key, (t.untyped_storage().nbytes(), op, str(tuple(t.shape)), str(t.dtype)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t) if mem is not None else contextlib.nullcontext():
        lp = model.token_logprobs(batch.input_ids.to(device), batch.cu_seqlens, batch.targets.to(device))
    if mem is not None:
        by_op = {}
        for nbytes, op, shape, dtype in saved.values():
            by_op[f"{op} {shape} {dtype}"] = by_op.get(f"{op} {shape} {dtype}", 0) + nbytes
        mem["saved_by_op_gb"] = {k: round(v / GB, 2) for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]}
    mask = batch.response_mask.to(device)
    loss = -(token_adv.to(device) * lp)[mask].sum() / mask.sum()
    if mem is not None:
        mem["after_forward"] = torch.cuda.memory_allocated()
        mem["forward_peak"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    loss.backward()
    optimizer.step()
    if mem is not None:
        mem["backward_peak"] = torch.cuda.max_memory_allocated()  # backward and the optimizer step
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


PEAK_BF16 = 989.4e12  # H100/H200 SXM dense bf16, datasheet
MEASURED_BF16 = 790e12  # bf16 GEMM on random data on this workplace's H200 (device README)


def model_flops(t: dict, seq_len: int, seqs: int, rank: int) -> dict:
    """FLOPs of one step that a frozen-base LoRA trainer must do: every base GEMM forward and its input gradient
    (no weight gradient), MSA over the selected keys (forward; backward counted as twice that), LoRA forward, input
    and weight gradients; recompute (activation checkpointing) not counted, the indexer's block scores not counted."""
    h, L = t["hidden_size"], t["num_hidden_layers"]
    hq, hkv, d = t["num_attention_heads"], t["num_key_value_heads"], t["head_dim"]
    sp = t.get("sparse_attention_config") or {}
    ih, idim = sp.get("sparse_num_index_heads", 0), sp.get("sparse_index_dim", 0)
    inter, shared, k = t["intermediate_size"], t.get("shared_intermediate_size", 0), t["num_experts_per_tok"]
    moe = t.get("moe_layer_freq") or [1] * L
    sparse = sp.get("sparse_attention_freq") or [0] * L
    keys_cap = sp.get("sparse_topk_blocks", 0) * sp.get("sparse_block_size", 0)
    pos = torch.arange(seq_len, dtype=torch.float64) + 1
    # (in, out) of each base linear per token, and whether LoRA adapts it (rl.model.lora defaults: all of them)
    attn = [(h, hq * d), (h, hkv * d), (h, hkv * d), (hq * d, h)]
    index = [(h, ih * idim), (h, idim)]
    out = {"base_linear": 0.0, "routed_experts": 0.0, "attention": 0.0, "lm_head": 0.0, "lora": 0.0}
    for layer in range(L):
        lin = attn + (index if sparse[layer] else [])
        mlp = [(h, 2 * shared), (shared, h)] if moe[layer] else [(h, 2 * t["dense_intermediate_size"]),
                                                                   (t["dense_intermediate_size"], h)]
        experts = [(h, 2 * inter), (inter, h)] * k if moe[layer] else []
        out["base_linear"] += sum(2 * a * b for a, b in lin + mlp) + (2 * h * t["num_local_experts"] if moe[layer]
                                                                        else 0)
        out["routed_experts"] += sum(2 * a * b for a, b in experts)
        out["lora"] += sum(2 * rank * (a + b) for a, b in lin + mlp + experts)
        keys = pos.clamp(max=keys_cap) if sparse[layer] else pos
        out["attention"] += float(4 * hq * d * keys.mean())  # QK^T and PV per token
    out["lm_head"] = 2 * h * t["vocab_size"]
    tokens = seq_len * seqs
    per_token = {key: v * tokens for key, v in out.items()}
    # frozen base: forward + input gradient; attention: forward + 2x backward; LoRA: forward + input + weight grads
    total = {"base_linear": 2 * per_token["base_linear"], "routed_experts": 2 * per_token["routed_experts"],
             "lm_head": 2 * per_token["lm_head"], "attention": 3 * per_token["attention"],
             "lora": 3 * per_token["lora"]}
    total["total"] = sum(total.values())
    return total


CATEGORIES = ("expert", "attention", "projections", "lm_head")
TOP_KERNELS = 40


def _labelled(fn, name):
    import functools

    @functools.wraps(fn)
    def wrapper(*a, **kw):
        with torch.profiler.record_function(f"m3/{name}"):
            return fn(*a, **kw)
    return wrapper


def profile_step(model, optimizer, batch, token_adv, device, trace: str | None = None) -> dict:
    """GPU kernel time of one step by what launched it. Forward and recomputed-forward kernels take the innermost
    m3/<category> label around the call (routed experts incl. their LoRA and SwiGLU, not the weighted sum; attention
    incl. MSA and the indexer; projections: every base linear with its LoRA, the shared expert's too; LM head);
    backward kernels take the label of the forward op whose autograd node ran them (matched by sequence number).
    Everything else is "other" (norms, routing, the weighted sum, embedding, the optimizer). trace: a path the
    step's Chrome trace is written to (gzipped where it ends in .gz)."""
    from quant import serving
    from rl.model import lora as lora_mod
    from rl.model import quantized_base
    from rl.model import transformer as model_mod

    patches = [(model_mod.MoE, "_experts", "expert"), (model_mod.Attention, "forward", "attention"),
               (serving.MXFP8Linear, "forward", "projections"), (quantized_base.DenseLinear, "forward", "projections"),
               (lora_mod.LoRALinear, "forward", "projections"), (model_mod, "lm_head_logprobs", "lm_head")]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, cat in patches:
        setattr(obj, name, _labelled(getattr(obj, name), cat))
    try:
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            step(model, optimizer, batch, token_adv, device)
            torch.cuda.synchronize()
    finally:
        for obj, name, fn in saved:
            setattr(obj, name, fn)
    t0 = time.perf_counter()
    if trace:
        prof.export_chrome_trace(trace)  # torch gzips a path ending in .gz
    events = prof.events()

    def label(e):
        while e is not None:
            if e.name.startswith("m3/"):
                return e.name[3:], None
            if e.name.startswith("autograd::engine::evaluate_function"):
                return None, e
            e = e.cpu_parent
        return None, None

    fwd_cat, split, device_total = {}, {c: 0.0 for c in (*CATEGORIES, "other", "other_backward")}, 0.0
    for e in events:
        if e.device_type == torch.autograd.DeviceType.CPU and getattr(e, "sequence_nr", -1) >= 0:
            cat, _ = label(e)
            if cat is not None:
                fwd_cat.setdefault((e.thread, e.sequence_nr), cat)
        elif e.device_type == torch.autograd.DeviceType.CUDA and not e.name.startswith("m3/"):
            # (the m3/ labels also appear as GPU-side annotation ranges spanning their kernels: not kernels)
            device_total += e.device_time_total if hasattr(e, "device_time_total") else 0.0
    attributed, by_kernel = 0.0, collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        kernels = getattr(e, "kernels", None)
        if e.device_type != torch.autograd.DeviceType.CPU or not kernels:
            continue
        us = sum(k.duration for k in kernels)
        cat, node = label(e)
        if cat is None and node is not None:
            cat = fwd_cat.get((getattr(node, "fwd_thread", node.thread), node.sequence_nr), "other_backward")
        split[cat or "other"] += us
        attributed += us
        # by category, the op that launched it (in backward: its autograd node) and the kernel: the next bottleneck
        op = node.name.removeprefix("autograd::engine::evaluate_function: ") if node is not None else e.name
        for k in kernels:
            row = by_kernel[(cat or "other", op[:60], k.name[:100])]
            row[0] += k.duration
            row[1] += 1
    top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]
    by_op = collections.defaultdict(lambda: [0.0, 0])  # every kernel, summed by (category, op): a category's parts
    for (c, op, _), (us, n) in by_kernel.items():
        by_op[(c, op)][0] += us
        by_op[(c, op)][1] += n
    # the step's GPU idle time (no kernel on any stream), its largest gaps and the kernel pairs around the most of it
    spans = gpu_idle.kernel_spans(events)
    idle = gpu_idle.idle_gaps(spans, top=15)
    return {"gpu_ms": {k: round(v / 1e3, 1) for k, v in split.items()},
            "gpu_idle": {"span_ms": round(idle["span_us"] / 1e3, 1), "idle_ms": round(idle["idle_us"] / 1e3, 1),
                         "gaps": idle["gaps"], "largest_gaps": idle["largest_gaps"],
                         "idle_by_neighbours": idle["idle_by_neighbours"],
                         "host_during_idle": gpu_idle.host_during_gaps(gpu_idle.gap_list(spans), events, top=15)},
            "attributed_gpu_ms": round(attributed / 1e3, 1), "device_events_gpu_ms": round(device_total / 1e3, 1),
            "top_kernels": [{"category": c, "op": op, "kernel": k, "ms": round(us / 1e3, 1), "launches": n}
                            for (c, op, k), (us, n) in top],
            "by_op": [{"category": c, "op": op, "ms": round(us / 1e3, 1), "launches": n}
                      for (c, op), (us, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:TOP_KERNELS]],
            "analysis_s": round(time.perf_counter() - t0, 1)}


class GcClock:
    """Seconds in Python's cyclic collector and its passes per generation, from gc.callbacks."""

    def __init__(self):
        self.seconds, self.passes, self._t = 0.0, [0, 0, 0], 0.0
        gc.callbacks.append(self._tick)

    def _tick(self, phase, info):
        if phase == "start":
            self._t = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t
            self.passes[info["generation"]] += 1


def main(argv=None) -> int:
    args = parse_args(argv)
    from torch.distributed.device_mesh import init_device_mesh

    rank, world, device = init_process_group(args.device)
    t = text_config(args)
    mesh = init_device_mesh(device.type, (world,))
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t0 = time.perf_counter()
    model, params = build(args, t, device, mesh)
    sync()
    build_s = time.perf_counter() - t0
    frozen = [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())
    base_bytes = local_bytes(frozen)
    packed_bytes = local_bytes([x for x in frozen if x.element_size() == 1])  # NVFP4 / MXFP8 bytes and scales
    lora_bytes = local_bytes(params)
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    batch, token_adv = make_batch(args, t, rank, device)
    if args.gc_freeze:
        from rl.heap import freeze_heap

        freeze_heap()
    clock = GcClock()
    times, losses, mems, gc_s = [], [], [], []
    alloc_keys = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams")
    alloc0 = {}
    for i in range(args.warmup_steps + args.steps):
        mem = {} if cuda and i >= args.warmup_steps else None
        sync()
        if cuda and i == args.warmup_steps:  # the caching allocator's device calls over the timed steps (each
            alloc0 = {k: torch.cuda.memory_stats().get(k, 0) for k in alloc_keys}  # cudaMalloc/Free can sync)
        s0, g0 = time.perf_counter(), clock.seconds
        losses.append(step(model, optimizer, batch, token_adv, device, mem))
        sync()
        times.append(time.perf_counter() - s0)
        gc_s.append(clock.seconds - g0)
        if i + 1 == args.warmup_steps:
            clock.passes = [0, 0, 0]
        if mem is not None:
            mems.append(mem)
    timed = times[args.warmup_steps:]
    mine = {"rank": rank, "build_s": round(build_s, 2), "step_s": [round(x, 3) for x in times],
            "base_local_gb": base_bytes / GB, "packed_local_gb": packed_bytes / GB, "lora_local_gb": lora_bytes / GB,
            "loss": losses, "gc_s": [round(x, 3) for x in gc_s], "gc_passes_timed_steps": clock.passes,
            "finite": all(map(lambda x: x == x and abs(x) != float("inf"), losses))}
    if cuda:
        peak = max(max(m["forward_peak"], m["backward_peak"]) for m in mems)
        mine.update(peak_allocated_gb=peak / GB, peak_reserved_gb=torch.cuda.max_memory_reserved() / GB)
        mine["allocator_calls_timed_steps"] = {k: torch.cuda.memory_stats().get(k, 0) - alloc0[k] for k in alloc_keys}
        m = mems[-1]
        # Transient = peak - resident weights (frozen base + LoRA); the rest is named by phase.
        mine["memory_breakdown_gb"] = {
            "resident_weights": (base_bytes + lora_bytes) / GB,
            "optimizer_state_and_other_resident": (m["before_forward"] - base_bytes - lora_bytes) / GB,
            "saved_for_backward_after_forward": (m["after_forward"] - m["before_forward"]) / GB,
            "forward_working_set_peak": (m["forward_peak"] - m["after_forward"]) / GB,
            "backward_working_set_peak": (m["backward_peak"] - m["after_forward"]) / GB,
            "transient_peak": (peak - base_bytes - lora_bytes) / GB,
        }
        mine["saved_outside_checkpoints_gb"] = m["saved_by_op_gb"]
    if args.profile and cuda:
        mine["time_split"] = profile_step(model, optimizer, batch, token_adv, device, args.trace)
    if args.memory_peak and cuda:
        import cuda_memory_peak

        cuda_memory_peak.start()
        step(model, optimizer, batch, token_adv, device)
        mine["memory_at_peak"] = cuda_memory_peak.stop_and_summarize()
    ranks = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        tokens = args.seq_len * args.seqs_per_rank * world
        median = statistics.median(timed) if timed else None
        report = {
            "command": "torchrun --nproc-per-node {} {}".format(world, " ".join(
                [os.path.relpath(__file__, ROOT)] + (argv if argv is not None else sys.argv[1:]))),
            "device": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
            "world_size": world,
            "shape": {k: t[k] for k in ("num_hidden_layers", "hidden_size", "num_local_experts",
                                        "num_experts_per_tok", "intermediate_size", "num_attention_heads",
                                        "num_key_value_heads", "vocab_size")},
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "config")},
            "tokens_per_step": tokens, "step_s_median": median,
            "tokens_per_s": tokens / median if median else None,
            "model_flops": (fl := model_flops(t, args.seq_len, args.seqs_per_rank * world, args.lora_rank)),
            "mfu_vs_989_tflops": fl["total"] / median / world / PEAK_BF16 if median else None,
            "mfu_vs_measured_790_tflops": fl["total"] / median / world / MEASURED_BF16 if median else None,
            "peak_allocated_gb_max": max(r.get("peak_allocated_gb", 0) for r in ranks),
            "ranks": ranks,
        }
        text = json.dumps(report, indent=1)
        print(text, flush=True)
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(text + "\n")
    dist.barrier()
    dist.destroy_process_group()
    return 0 if mine["finite"] else 1


def exit_without_finalizing(code: int) -> None:
    """Ends the process without the interpreter's finalization. torch's gloo worker threads free a finished
    collective's work object after the caller's wait() has returned; the trailing barrier keeps the last
    all_gather_object's work (and its Python-owned tensors) until the barrier's own object is freed. When the main
    thread reaches Py_Finalize first, the worker's decref of those tensors must take the GIL, the finalizing
    interpreter ends that thread, and the forced unwind aborts the process ("terminate called without an active
    exception", SIGABRT in 13 of 426 two-rank CPU launches before this, backtrace in ~AsyncBarrierWork -> ~AsyncAllgatherWork
    -> TensorImpl::decref_pyobject). Everything this script writes is closed and flushed by then."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    exit_without_finalizing(main())
