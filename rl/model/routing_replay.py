"""MoE routing as vLLM computes it, with replay of the engine's choices.

vLLM (fused_topk_bias / our CPU router): `s = sigmoid(logits_fp32)`, experts = topk(s + e_score_correction_bias),
weights = s[experts] / sum(s[experts]) * routed_scaling_factor. Top-k over near-tied scores is discontinuous, so
a 1e-7 difference can flip an expert; replay uses the engine's expert ids and recomputes the weights from the
trainer's own scores over those ids (gradients flow through the weights into the router logits).
"""

import torch


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, scaling: float,
          replay_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(weights fp32 [T, k], ids used [T, k], the trainer's own top-k ids [T, k])."""
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    own = choice.topk(top_k, dim=-1).indices
    ids = own if replay_ids is None else replay_ids.long()
    weights = scores.gather(1, ids)
    return weights / weights.sum(-1, keepdim=True) * scaling, ids, own


def validate_replay(ids: torch.Tensor, num_tokens: int, num_layers: int, top_k: int, num_experts: int,
                    moe_layers: list[int], dense_marker: int) -> None:
    """Engine routing `[num_tokens, num_layers, top_k]` (dense layers = dense_marker); one clear error if not."""
    if tuple(ids.shape) != (num_tokens, num_layers, top_k):
        raise ValueError(f"routing replay has shape {tuple(ids.shape)}, expected [tokens={num_tokens}, "
                         f"layers={num_layers}, top_k={top_k}]")
    moe = ids[:, moe_layers].long()
    bad = (moe < 0) | (moe >= num_experts)
    if bad.any():
        t, l, k = bad.nonzero()[0].tolist()
        raise ValueError(f"routing replay: token {t} layer {moe_layers[l]} slot {k} has expert id "
                         f"{int(moe[t, l, k])}, outside [0, {num_experts})")
    dup = (moe.sort(-1).values.diff(dim=-1) == 0).any(-1)
    if dup.any():
        t, l = dup.nonzero()[0].tolist()
        raise ValueError(f"routing replay: token {t} layer {moe_layers[l]} repeats an expert: {moe[t, l].tolist()}")


def routing_match_rate(own: torch.Tensor, used: torch.Tensor) -> torch.Tensor:
    """routing_agreement as a 0-d tensor on the ids' device (no host sync inside the forward)."""
    return (own.sort(-1).values == used.sort(-1).values).all(-1).float().mean()


def routing_agreement(own: torch.Tensor, used: torch.Tensor) -> float:
    """Fraction of tokens whose own expert set equals the one used (1.0 without replay)."""
    return float(routing_match_rate(own, used))
