"""The trainer's discrete choices vs the engine's captured ones: experts per MoE layer, MSA blocks per sparse layer."""

import numpy as np
import torch

from rl.batch import PackedBatch
from rl.model import ForwardStats, msa
from rl.model.routing_replay import routing_agreement


def engine_agreement(model, stats: ForwardStats, batch: PackedBatch, replayed: dict[str, bool]) -> dict:
    """How often the trainer's own choice equals the engine's captured one, mean over layers: experts (MoE layers)
    and MSA blocks (sparse layers). Under replay the forward computes its own choice beside the replayed one;
    without, the choice it used is its own (kept by `stats.keep_choices`). A missing capture raises."""
    out = {}
    for key, layers, captured in (("routing", model.moe_layers, batch.routing),
                                  ("blocks", model.sparse_layers, batch.blocks)):
        if not layers:
            continue
        if captured is None:
            raise RuntimeError(f"{key} agreement: the engine captured no {key} for this batch")
        if replayed[key]:
            per_layer = list((stats.routing_agreement if key == "routing" else stats.block_agreement).values())
        elif key == "routing":
            engine = torch.as_tensor(captured).long()
            per_layer = [routing_agreement(stats.expert_ids[i].cpu(), engine[:, i]) for i in layers]
        else:
            engine = torch.as_tensor(captured).long()
            per_layer = [msa.selection_agreement(stats.block_ids[i].cpu(), engine[:, j]) for j, i in enumerate(layers)]
        out[key] = float(np.mean(per_layer))
    return out
