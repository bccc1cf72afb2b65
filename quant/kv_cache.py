"""NVFP4 KV-cache fake quantization (K, V and index keys), following the SM100 cache writer of
vLLM's MiniMax-M3 path (notes: vllm-minimax-m3.md section 4, "Writer math"):

    x   = bf16(x)                                  # the writer reads bf16 K/V
    per 16 elements along head_dim, g = k_scale (1.0 when the checkpoint has none):
    sf  = E4M3_RN_satfinite(max(max(amax, 1e-12) / (6 * g), 2^-9))     # in [2^-9, 448], never 0
    q   = sign(x) * RNE_E2M1(min(|x / g| / sf, 6)),  -0 -> +0
    x'  = q * sf * g

All divisions are IEEE (correctly rounded) fp32, as in the writer. Unlike the weight/activation
quantizer, a block scale is never zero (the 2^-9 floor), so tiny blocks keep non-zero codes.

Non-finite input (the writer's CUDA ``fmaxf`` ignores NaN when taking amax):
- NaN elements are left out of amax and encode as +0; the rest of the block is quantized normally;
- +-inf makes amax inf, the scale saturates at 448 and the inf elements become +-6 * 448 * g.
"""

from __future__ import annotations

import math

import torch

from quant._common import E2M1_MAX, check_last_dim, e2m1_codes, e2m1_values, to_e4m3

BLOCK = 16
_AMAX_FLOOR = 1e-12
_MIN_SCALE = 2.0**-9  # smallest E4M3 subnormal: keeps the scale non-zero

__all__ = ["BLOCK", "nvfp4_kv_qdq"]


def _global_scale(global_scale: float | torch.Tensor) -> float:
    if isinstance(global_scale, torch.Tensor):
        if global_scale.numel() != 1:
            raise ValueError(
                f"global_scale has shape {tuple(global_scale.shape)}; expected one element "
                "(a per-layer k_scale / v_scale)"
            )
        global_scale = float(global_scale.item())
    g = float(global_scale)
    # The CUDA writer traps on these; failing here gives a readable error instead of NaN caches.
    if not (math.isfinite(g) and g > 0):
        raise ValueError(f"global_scale={g!r}: the KV-cache scale must be finite and > 0")
    return g


def _kv_qdq(x: torch.Tensor, g: float) -> torch.Tensor:
    xb = x.to(torch.bfloat16).to(torch.float32)
    xb = xb.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    nan = torch.isnan(xb)
    amax = torch.where(nan, 0.0, xb.abs()).amax(dim=-1).clamp(min=_AMAX_FLOOR)
    g32 = torch.tensor(g, dtype=torch.float32, device=x.device)
    sf = to_e4m3((amax / (6.0 * g32)).clamp(min=_MIN_SCALE)).to(torch.float32).unsqueeze(-1)
    mag = ((xb / g32).abs() / sf).clamp(max=E2M1_MAX)
    codes = torch.where(nan, 0, e2m1_codes(mag))  # |.| >= 0, so only magnitude bits are set
    # Sign only on non-zero magnitudes: the writer stores -0 as +0.
    neg = (xb < 0) & (codes != 0)
    vals = e2m1_values(codes | (neg.to(torch.uint8) << 3))
    return ((vals * sf) * g32).reshape(x.shape).to(x.dtype)


class _KVQDQ(torch.autograd.Function):
    """Straight-through estimator: the cache write is a rounding, its gradient is taken as 1."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, g: float) -> torch.Tensor:  # noqa: D102
        return _kv_qdq(x, g)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return grad, None


def nvfp4_kv_qdq(x: torch.Tensor, global_scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """NVFP4 quantize-dequantize of K, V or index keys [..., head_dim] (head_dim % 16 == 0).

    Returns a tensor of x's dtype and shape holding what the cache reader reconstructs as
    e2m1 * E4M3 scale * global_scale. Gradients pass straight through.
    """
    check_last_dim(x, "x", BLOCK)
    if not x.is_floating_point():
        raise ValueError(f"x has dtype {x.dtype} (shape {tuple(x.shape)}); expected a float tensor")
    return _KVQDQ.apply(x, _global_scale(global_scale))
