"""Mismatch attribution: where the train/rollout KL comes from (`python -m rl.check check.attribution=true`).

The trainer's forward runs over the same engine rollouts once exactly as configured (the baseline) and once per
variant that removes one source of agreement with the engine; each row reports KL(k3), KL(k1), mean / max
|dlogprob|, the fraction of response tokens with |dlogprob| > 0.1, and the trainer's own expert / block choices'
agreement with the engine's. A variant whose KL rises above the baseline's is a source the exact setup removes.
"""

from contextlib import contextmanager
from dataclasses import replace

import torch

from rl.agreement import engine_agreement
from rl.algorithm import train_rollout_kl
from rl.batch import PackedBatch
from rl.model import ForwardStats, M3ForTraining
from rl.model.lora import load_adapter_tensors
from rl.model.quantized_base import DenseLinear, ExpertWeights

VARIANTS = {
    "exact": "the configured setup: served base form, engine LoRA precision, KV QDQ as the engine's cache, replay",
    "no_routing_replay": "the trainer's own top-k experts instead of the engine's",
    "no_block_replay": "the trainer's own MSA block selection instead of the engine's",
    "bf16_base": "the base dequantized to plain bf16 weights (no served quant form): a bf16 trainer against this engine",
    "no_kv_qdq": "no NVFP4 QDQ of K/V and index keys (matters when the engine's caches are NVFP4)",
    "plain_lora": "LoRA in peft's precision (both GEMMs in the activation dtype) instead of vLLM's Punica order",
}


@contextmanager
def _modules_set(model, attr: str, value):
    """Set `attr` on every submodule that has it, restore on exit."""
    saved = [(m, getattr(m, attr)) for m in model.modules() if hasattr(m, attr)]
    for m, _ in saved:
        setattr(m, attr, value)
    try:
        yield model
    finally:
        for m, old in saved:
            setattr(m, attr, old)


@contextmanager
def _variant(name: str, model: M3ForTraining, adapter_tensors: dict):
    if name == "bf16_base":
        other = M3ForTraining(replace(model.mcfg, base="bf16"))
        with torch.no_grad():  # plain weights held in bf16 whatever the compute dtype (a no-op in a bf16 model)
            for module in other.modules():
                if isinstance(module, (DenseLinear, ExpertWeights)):
                    for buf in module.buffers(recurse=False):
                        buf.copy_(buf.to(torch.bfloat16))
        load_adapter_tensors(other, adapter_tensors)
        yield other
    elif name == "no_kv_qdq":
        with _modules_set(model, "kv_nvfp4", False), _modules_set(model, "index_nvfp4", False):
            yield model
    elif name == "plain_lora":
        with _modules_set(model, "plain_precision", True):
            yield model
    else:
        yield model


def attribute(model: M3ForTraining, batch: PackedBatch, replay: dict[str, bool], adapter_tensors: dict) -> dict:
    """One row per variant (VARIANTS), computed over `batch` (the engine's rollouts with its captures)."""
    rows = {}
    for name in VARIANTS:
        on = {"routing": replay["routing"] and name != "no_routing_replay",
              "blocks": replay["blocks"] and name != "no_block_replay"}
        stats = ForwardStats(keep_choices=True)
        with _variant(name, model, adapter_tensors) as m, torch.no_grad():
            lp = m.token_logprobs(batch.input_ids, batch.cu_seqlens, batch.targets, stats=stats,
                                  routing=batch.routing if on["routing"] else None,
                                  blocks=batch.blocks if on["blocks"] else None)
            agreement = engine_agreement(m, stats, batch, on)
        kl = train_rollout_kl(lp, batch.rollout_logprobs, batch.response_mask)
        delta = (lp - batch.rollout_logprobs)[batch.response_mask].abs()
        rows[name] = {"kl_k3": kl["kl_k3"], "kl_k1": kl["kl_k1"], "logprob_abs_diff_mean": kl["logprob_abs_diff_mean"],
                      "logprob_abs_diff_max": kl["logprob_abs_diff_max"],
                      "frac_abs_diff_gt_0.1": float((delta > 0.1).float().mean()),
                      **{f"agreement_{k}": v for k, v in agreement.items()}}
    return {"variants": rows, "what": VARIANTS, "tokens": int(batch.response_mask.sum())}


def print_table(attribution: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"train/rollout mismatch by source ({attribution['tokens']} response tokens)")
    keys = list(next(iter(attribution["variants"].values())))
    for col in ("variant", *(HEADERS.get(k, k) for k in keys)):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for name, row in attribution["variants"].items():
        table.add_row(name, *(f"{row[k]:.3g}" for k in keys))
    Console(stderr=True, width=140).print(table)


HEADERS = {"kl_k3": "KL k3", "kl_k1": "KL k1", "logprob_abs_diff_mean": "mean |d|", "logprob_abs_diff_max": "max |d|",
           "frac_abs_diff_gt_0.1": "|d|>0.1", "agreement_routing": "experts =", "agreement_blocks": "blocks ="}
