"""transformers' MiniMax-M3 as the independent reference for the engine (test helper).

vLLM keeps the indexer's q/k in bf16 even in fp32 models (the index cache is bf16), so the reference rounds the
index q/k to bf16 after norm + RoPE; `index_bf16=False` gives plain transformers. It also records the blocks each
sparse layer's indexer selects.
"""

import contextlib

import torch
from transformers.models.minimax_m3_vl import modeling_minimax_m3_vl as hf_m3


@contextlib.contextmanager
def reference_mode(index_bf16: bool = True):
    """Patch the transformers indexer for the duration; yields {layer_idx: int [H, T, topk]} selections."""
    selections: dict[int, torch.Tensor] = {}
    indexer_forward = hf_m3.MiniMaxM3VLIndexer.forward
    rope = hf_m3.apply_rotary_pos_emb

    def bf16_rope(q, k, cos, sin, *a, **kw):
        q, k = rope(q, k, cos, sin, *a, **kw)
        return q.to(torch.bfloat16).to(q.dtype), k.to(torch.bfloat16).to(k.dtype)

    def forward(self, *args, **kwargs):
        if index_bf16:
            hf_m3.apply_rotary_pos_emb = bf16_rope
        try:
            ids = indexer_forward(self, *args, **kwargs)
        finally:
            hf_m3.apply_rotary_pos_emb = rope
        selections[self.layer_idx] = ids[0].detach().clone()
        return ids

    hf_m3.MiniMaxM3VLIndexer.forward = forward
    try:
        yield selections
    finally:
        hf_m3.MiniMaxM3VLIndexer.forward = indexer_forward


def load_reference(hf_dir, dtype=torch.float32):
    model, info = hf_m3.MiniMaxM3VLForCausalLM.from_pretrained(
        str(hf_dir), dtype=dtype, attn_implementation="sdpa", output_loading_info=True)
    missing = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
    assert not missing, f"reference checkpoint does not load cleanly: {missing}"
    return model.eval()


@torch.no_grad()
def teacher_forced(model, token_ids: list[int], index_bf16: bool = True):
    """(logprobs [T, V] of next tokens given each prefix, {layer: block ids [H, T, topk]})."""
    with reference_mode(index_bf16) as selections:
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1), dict(selections)
