"""transformers' MiniMax-M3 as the independent reference for the engine (test helper).

vLLM keeps the indexer's q/k in bf16 even in fp32 models (the index cache is bf16), so the reference rounds the
index q/k to bf16 after norm + RoPE; `index_bf16=False` gives plain transformers. It records the blocks each
sparse layer's indexer selects and the experts each MoE layer's router picks.
"""

import contextlib
from dataclasses import dataclass

import torch
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf_m3

from quant.kv_cache import nvfp4_kv_qdq


@dataclass
class Reference:
    logprobs: torch.Tensor  # [T, V]: next-token logprobs after each prefix
    blocks: dict[int, torch.Tensor]  # layer -> [H, T, topk] selected block ids (-1 padded)
    routing: dict[int, torch.Tensor]  # layer -> [T, topk] expert ids

    def token_logprobs(self, ids: list[int]) -> torch.Tensor:
        """logprob of ids[i+1] given ids[:i+1], for i in 0..len-2."""
        return self.logprobs[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


@contextlib.contextmanager
def reference_mode(model, index_bf16: bool = True, kv_nvfp4: bool = False, index_k_nvfp4: bool = False):
    """index_bf16: round index q/k to bf16 after RoPE (vLLM's bf16 index cache); kv_nvfp4 / index_k_nvfp4: apply
    the NVFP4 cache writer's QDQ to K and V / to the index keys, as the engine stores them."""
    blocks, routing = {}, {}
    indexer_forward = hf_m3.MiniMaxM3VLIndexer.forward
    rope = hf_m3.apply_rotary_pos_emb

    def main_rope(q, k, cos, sin, *a, **kw):
        q, k = rope(q, k, cos, sin, *a, **kw)
        return q, (nvfp4_kv_qdq(k) if kv_nvfp4 else k)

    def index_rope(q, k, cos, sin, *a, **kw):
        q, k = rope(q, k, cos, sin, *a, **kw)
        if index_bf16:
            q, k = q.to(torch.bfloat16).to(q.dtype), k.to(torch.bfloat16).to(k.dtype)
        return q, (nvfp4_kv_qdq(k) if index_k_nvfp4 else k)

    def forward(self, *args, **kwargs):
        hf_m3.apply_rotary_pos_emb = index_rope
        try:
            ids = indexer_forward(self, *args, **kwargs)
        finally:
            hf_m3.apply_rotary_pos_emb = main_rope
        blocks[self.layer_idx] = ids[0].detach().clone()
        return ids

    hooks = []
    if kv_nvfp4:
        for layer in model.model.layers:
            hooks.append(layer.self_attn.v_proj.register_forward_hook(lambda mod, inp, out: nvfp4_kv_qdq(out)))
    for i, layer in enumerate(model.model.layers):
        gate = getattr(layer.mlp, "gate", None)
        if isinstance(gate, hf_m3.MiniMaxM3VLTopKRouter):
            hooks.append(gate.register_forward_hook(
                lambda mod, inp, out, i=i: routing.__setitem__(i, out[2].detach().clone())))
    hf_m3.MiniMaxM3VLIndexer.forward = forward
    hf_m3.apply_rotary_pos_emb = main_rope
    try:
        yield blocks, routing
    finally:
        hf_m3.MiniMaxM3VLIndexer.forward = indexer_forward
        hf_m3.apply_rotary_pos_emb = rope
        for h in hooks:
            h.remove()


def load_reference(hf_dir, dtype=torch.float32):
    model, info = hf_m3.MiniMaxM3VLForCausalLM.from_pretrained(
        str(hf_dir), dtype=dtype, attn_implementation="sdpa", output_loading_info=True)
    missing = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not missing, f"reference checkpoint does not load cleanly: {missing}"
    return model.eval()


@torch.no_grad()
def teacher_forced(model, token_ids: list[int], **mode) -> Reference:
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    with reference_mode(base, **mode) as (blocks, routing):
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].float()
    return Reference(torch.log_softmax(logits, dim=-1), dict(blocks), dict(routing))


def block_sets(ids: torch.Tensor) -> list[set[int]]:
    """Per head, the set of selected blocks (the order among forced blocks is not part of the contract)."""
    return [set(row[row >= 0].tolist()) for row in ids]
