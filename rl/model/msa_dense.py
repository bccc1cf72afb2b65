"""Dense causal attention of packed sequences for MSA (rl.model.msa_block_outer): a batch whose sequences all fit in
the top-k blocks, and the dense prefixes (queries at positions < topk*128 select every visible block).

One varlen FlashAttention call (`torch.nn.attention.varlen`) where SDPA per sequence would wait on the host
(`prefers_varlen`), else SDPA per sequence (on the H200 cuDNN's kernels, faster per FLOP). q [T, Hq, D], k/v
[T, Hkv, D] with Hkv | Hq, consecutive sequences of `lengths` rows covering them.
"""

from __future__ import annotations

import functools
import inspect
import itertools

import torch
import torch.nn.functional as F

from rl.model.packed import to_device

# The dense path's choice (results/gpu/run111, H200, 64 q / 4 KV heads, d 128): SDPA per sequence runs cuDNN's
# kernels there, ~15% faster per FLOP than the varlen FlashAttention-2 kernel, but costs ~0.45 ms of host time per
# sequence (fwd+bwd) and, through each slice's backward, a full-size gradient per sequence. One varlen call wins from
# 5 sequences (8 x 2048: 7.5 vs 8.2 ms fwd+bwd) or at <= 1,024 tokens each (2 x 1024: 1.29 vs 1.39, 4 x 1024: 1.54 vs
# 1.95); SDPA wins for 2-4 longer ones (2 x 1536: 1.45 vs 1.65, 4 x 2048: 3.57 vs 4.01; 4 x 1536: 2.68 vs 2.46, the
# one case this rule loses).
VARLEN_MIN_SEQS = 5
VARLEN_MAX_TOKENS = 1024


def prefers_varlen(lengths: list) -> bool:
    """Whether causal attention over sequences of `lengths` tokens goes as one varlen call (where one can run)."""
    return len(lengths) >= VARLEN_MIN_SEQS or (len(lengths) > 1 and max(lengths) <= VARLEN_MAX_TOKENS)


def causal_dense(q, k, v, lengths: list, scale: float):
    """Causal attention of consecutive row spans of q/k/v (`lengths` rows each, covering them): one varlen
    FlashAttention call on CUDA where torch has one for these inputs (`_varlen`) and the batch is host-bound as SDPA
    calls (`prefers_varlen`), else SDPA per span."""
    varlen = _varlen(q.device, q.dtype, q.shape[2]) if prefers_varlen(lengths) else None
    if varlen is not None:
        cu = _cu_seqlens(tuple(lengths), q.device)
        return varlen(q, k, v, cu, cu, max(lengths), max(lengths), scale=scale)
    outs, start = [], 0
    for length in lengths:
        qs, ks, vs = (x[start:start + length].transpose(0, 1)[None] for x in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale,
                                                   enable_gqa=qs.shape[1] != ks.shape[1])[0].transpose(0, 1))
        start += length
    return torch.cat(outs) if outs else q.new_empty(0, *q.shape[1:])


@functools.lru_cache(maxsize=16)
def _varlen(device, dtype, dim: int):
    """torch's causal varlen FlashAttention (`varlen_causal`) for q/k/v on `device` in `dtype` with head dim `dim`,
    or None where it cannot run them (CPU, fp32, pre-Ampere, a torch without it)."""
    if (device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16) or dim % 8 or dim > 256
            or torch.cuda.get_device_capability(device)[0] < 8):
        return None
    return varlen_causal()


@functools.lru_cache(maxsize=None)
def varlen_causal():
    """torch.nn.attention.varlen.varlen_attn, causal and GQA-capable, or None in a torch without it. GQA: torch 2.13
    asks for enable_gqa=True, 2.11 has no such argument and hands FlashAttention Hq a multiple of Hkv as it is."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    gqa = {"enable_gqa": True} if "enable_gqa" in inspect.signature(varlen_attn).parameters else {}
    return functools.partial(varlen_attn, window_size=(-1, 0), **gqa)


@functools.lru_cache(maxsize=16)
def _cu_seqlens(lengths: tuple, device) -> torch.Tensor:
    """int32 offsets of consecutive spans on the device, once per batch layout (every layer has the same one).
    Read-only."""
    return to_device([0, *itertools.accumulate(lengths)], device, torch.int32)
