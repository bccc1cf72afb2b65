"""MXFP8 codec: float8_e4m3fn elements in 32-element blocks along the last dim, one E8M0 scale byte
per block (value 2^(byte - 127); byte 255 is NaN, there is no zero).

``quantize`` reproduces vLLM's torch quantizer ``_mxfp8_e4m3_quantize_torch`` (used on CUDA below
sm100 and on CPU): byte = clamp(ceil(log2(max(amax, 2^-126) / 448)) + 127, 0, 254), elements
RNE(x / 2^(byte-127)). The ceil rule never needs saturation for bf16 data; fp32 data can land a
hair above 448 (log2 rounds to an integer), which the RNE cast takes to 448 and our explicit clamp
keeps at 448 on every torch version.

Non-finite input (vLLM leaves NaN undefined: NaN is cast to uint8):
- a block holding NaN gets byte 255 and all-NaN elements (0x7F), so it decodes to NaN;
- +-inf gives byte 254 and +-448 for the inf elements (what vLLM yields on torch >= 2.13; torch 2.11
  casts them to NaN).
``dequantize`` maps byte 255 to NaN (vLLM computes x * 2^128 = +-inf, or NaN for x = 0).
"""

from __future__ import annotations

import torch

from quant._common import (
    E4M3_MAX,
    check_dtype,
    check_last_dim,
    swizzle_128x4,
    to_e4m3,
    unswizzle_128x4,
)

BLOCK = 32
E8M0_NAN = 255

__all__ = [
    "BLOCK", "dequantize", "e8m0_to_float", "qdq", "quantize", "swizzle_scales", "unswizzle_scales",
]

_FP32_TINY = torch.finfo(torch.float32).tiny  # 2^-126


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (float8_e4m3fn [..., K], uint8 E8M0 scale [..., K/32])."""
    check_last_dim(x, "x", BLOCK)
    if not x.is_floating_point():
        raise ValueError(f"x has dtype {x.dtype} (shape {tuple(x.shape)}); expected a float tensor")
    xb = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1)
    nan_block = torch.isnan(amax)
    # Same op sequence as vLLM (fp32 divide, log2, ceil) rather than exact integer exponent math:
    # for fp32 amax just above 448 * 2^k, log2 rounds to k and vLLM picks the smaller exponent.
    biased = (torch.ceil(torch.log2(amax.clamp(min=_FP32_TINY) / E4M3_MAX)) + 127.0).clamp(0.0, 254.0)
    biased = torch.where(nan_block, torch.zeros_like(biased), biased)
    scaled = xb / torch.exp2(biased - 127.0).unsqueeze(-1)
    scaled = torch.where(nan_block.unsqueeze(-1), float("nan"), scaled)
    q = to_e4m3(scaled).reshape(x.shape)
    scale = torch.where(nan_block, E8M0_NAN, biased.to(torch.uint8)).to(torch.uint8)
    return q, scale


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """uint8 (or float8_e8m0fnu) scale bytes -> fp32 2^(byte - 127); byte 255 -> NaN."""
    check_dtype(scale, "scale", torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
    b = scale.view(torch.uint8).to(torch.float32)
    return torch.where(b == E8M0_NAN, float("nan"), torch.exp2(b - 127.0))


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """e4m3 [..., K] + E8M0 [..., K/32] -> RNE_dtype(fp32(q) * 2^(byte-127)).

    Equal to vLLM ``dequant_mxfp8_to_bf16`` for dtype=bfloat16 and bytes < 255. Exact in bf16 unless
    the product falls below bf16's smallest subnormal (2^-133), i.e. only for bytes near 0.
    """
    check_dtype(q, "q", torch.float8_e4m3fn)
    check_last_dim(q, "q", BLOCK)
    if tuple(scale.shape) != (*q.shape[:-1], q.shape[-1] // BLOCK):
        raise ValueError(
            f"q has shape {tuple(q.shape)} and scale {tuple(scale.shape)}; expected scale "
            f"[..., K/{BLOCK}]"
        )
    vals = q.to(torch.float32).reshape(*scale.shape, BLOCK) * e8m0_to_float(scale).unsqueeze(-1)
    return vals.reshape(q.shape).to(dtype)


def qdq(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """MXFP8 quantize-dequantize (the W8A8 activation path on Blackwell), in ``dtype`` or x.dtype.
    Differentiable only through ``quant.forms`` (STE)."""
    q, s = quantize(x)
    return dequantize(q, s, dtype or x.dtype)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Row-major [..., M, K/32] -> 128x4 layout, shape [..., round_up(M,128), round_up(K/32,4)].
    Same layout as vLLM ``swizzle_mxfp8_scale`` (which returns it flattened)."""
    return swizzle_128x4(scale)


def unswizzle_scales(swizzled: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Inverse of ``swizzle_scales`` for m rows and k elements (k/32 scale columns)."""
    if k % BLOCK != 0:
        raise ValueError(f"k={k} must be a multiple of {BLOCK}")
    return unswizzle_128x4(swizzled, m, k // BLOCK)
