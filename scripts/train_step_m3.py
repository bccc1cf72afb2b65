#!/usr/bin/env python
"""Trainer steps of MiniMax-M3 at real width (and depth) under torchrun: FSDP2 over a synthetic served-format base
(NVFP4 routed experts, MXFP8 projections, drawn in memory on each GPU: rl.synthetic_base), rank-32 LoRA on every
target, a token-level policy-gradient loss, AdamW on the LoRA parameters.

    # full size (60 layers, 128 experts, vocab 200064), 8 GPUs, 8 x 16K tokens per step:
    torchrun --nproc-per-node 8 scripts/train_step_m3.py --seq-len 16384 --seqs-per-rank 1 --out m3_x8.json
    # one H200, reduced depth (the last 2 of M3's layers: MoE + MSA), quantized vs bf16 base:
    torchrun --nproc-per-node 1 scripts/train_step_m3.py --layers 2 --seqs-per-rank 8 --base quantized
    # CPU smoke test (gloo): --device cpu --override '{"hidden_size": 256, ...}'

The shapes come from recipes/minimax_m3_text_config.json (vLLM's MiniMaxM3TextConfig defaults, which are the
MiniMax-M3 checkpoint's text_config); `--layers N` keeps the last N layers of its layer pattern. Every rank draws the
same weights (seed) and keeps its FSDP2 shard; `--shard-base` (default) shards the packed base too (rl/fsdp.py).
Per rank the report holds the peak CUDA memory (allocated and reserved) over the timed steps, the local bytes of the
base and of LoRA, and the step times; rank 0 writes one JSON document (stdout, and --out), "command" first.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

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
    p.add_argument("--base", choices=("quantized", "bf16"), default="quantized")
    p.add_argument("--shard-base", type=int, choices=(0, 1), default=1, help="FSDP2-shard the frozen base")
    p.add_argument("--activation-checkpointing", type=int, choices=(0, 1), default=1)
    p.add_argument("--moe-chunk-tokens", type=int, default=0, help="model.moe_chunk_tokens (0: off)")
    p.add_argument("--lora-rank", type=int, default=32)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def text_config(args) -> dict:
    from rollout.tiny_model import DEFAULT_TEXT_CONFIG, DERIVED_KEYS, SPARSE_DEFAULTS, resolve_text_config, \
        validate_config

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
    from rl.fsdp import shard_layer, shard_model
    from rl.lora import LoRAConfig, lora_parameters
    from rl.model import M3ForTraining, TrainerModelConfig
    from rl.quantized_base import BaseWeights
    from rl.synthetic_base import SyntheticCheckpoint

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


def step(model, optimizer, batch, token_adv, device):
    """One optimizer step. The loss is the token-level REINFORCE form of rl.algorithm's (-A * log pi over response
    tokens, IS weight 1): its cost is nothing next to the model's, and it keeps this launcher free of verl/Hydra,
    which the GPU machines may lack."""
    lp = model.token_logprobs(batch.input_ids.to(device), batch.cu_seqlens.to(device), batch.targets.to(device))
    mask = batch.response_mask.to(device)
    loss = -(token_adv.to(device) * lp)[mask].sum() / mask.sum()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


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
    times, losses = [], []
    for i in range(args.warmup_steps + args.steps):
        if i == args.warmup_steps and cuda:
            torch.cuda.reset_peak_memory_stats()
        sync()
        s0 = time.perf_counter()
        losses.append(step(model, optimizer, batch, token_adv, device))
        sync()
        times.append(time.perf_counter() - s0)
    timed = times[args.warmup_steps:]
    mine = {"rank": rank, "build_s": round(build_s, 2), "step_s": [round(x, 3) for x in times],
            "base_local_gb": base_bytes / GB, "packed_local_gb": packed_bytes / GB, "lora_local_gb": lora_bytes / GB, "loss": losses,
            "finite": all(map(lambda x: x == x and abs(x) != float("inf"), losses))}
    if cuda:
        mine.update(peak_allocated_gb=torch.cuda.max_memory_allocated() / GB,
                    peak_reserved_gb=torch.cuda.max_memory_reserved() / GB)
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


if __name__ == "__main__":
    sys.exit(main())
