"""Shared helpers for tests/quant: device parametrization, bitwise comparison, vLLM oracles and a
few independent pure-Python references (written from the format definitions, not from vLLM).

The vLLM oracles are always evaluated on CPU copies: their CPU/torch formulas are the targets the
trainer reproduces (vLLM's CUDA paths are Triton kernels with approximate division, not oracles).
"""

from __future__ import annotations

import math

import pytest
import torch
from vllm.model_executor.layers.quantization.utils import (  # noqa: F401  (re-exported)
    marlin_utils_fp4,
    mxfp8_utils,
    nvfp4_emulation_utils,
)

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Integer view of a tensor's bytes, on CPU (so -0.0 != +0.0 and NaN payloads are visible)."""
    t = t.detach().cpu().contiguous()
    return t.view(_INT_VIEW[t.element_size()])


def assert_bitwise_equal(actual: torch.Tensor, expected: torch.Tensor, nan_equal: bool = False) -> None:
    """Same dtype, same shape, same bits. With nan_equal, any NaN matches any NaN."""
    assert actual.dtype == expected.dtype, (actual.dtype, expected.dtype)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    a, e = actual.detach().cpu(), expected.detach().cpu()
    mask = torch.ones(a.shape, dtype=torch.bool)
    if nan_equal:
        an, en = torch.isnan(a.float()), torch.isnan(e.float())
        assert torch.equal(an, en), f"NaN positions differ: {int((an != en).sum())}"
        mask = ~an
    diff = (bits(a) != bits(e)) & mask
    n = int(diff.sum())
    if n:
        idx = diff.nonzero()[:5].tolist()
        sample = [(i, a[tuple(i)].item(), e[tuple(i)].item()) for i in idx]
        raise AssertionError(f"{n} of {a.numel()} elements differ bitwise; first: {sample}")


def cpu(*ts):
    return tuple(t.cpu() if isinstance(t, torch.Tensor) else t for t in ts)


# ---- vLLM oracles (CPU) ------------------------------------------------------------------------


def vllm_nvfp4_quant(x: torch.Tensor, gs_enc: torch.Tensor):
    """vLLM ref_nvfp4_quant on CPU for [..., K] input -> (e2m1 float values, fp32 scales)."""
    x2 = x.detach().cpu().reshape(-1, x.shape[-1])
    vals, scale = nvfp4_emulation_utils.ref_nvfp4_quant(x2, gs_enc.cpu().reshape(1), 16)
    return vals.reshape(x.shape), scale.reshape(*x.shape[:-1], x.shape[-1] // 16)


def vllm_nvfp4_dequant(packed, scale, gs_dec, dtype):
    return nvfp4_emulation_utils.dequantize_to_dtype(
        packed.cpu(), scale.cpu(), gs_dec.cpu(), dtype, 16, swizzle=False
    )


def vllm_nvfp4_qdq(x: torch.Tensor, gs_enc: torch.Tensor) -> torch.Tensor:
    return nvfp4_emulation_utils.ref_nvfp4_quant_dequant(x.cpu(), gs_enc.cpu().reshape(1), 16)


def vllm_mxfp8_quant(x: torch.Tensor):
    return mxfp8_utils._mxfp8_e4m3_quantize_torch(x.cpu())


def vllm_mxfp8_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return mxfp8_utils.dequant_mxfp8_to_bf16(q.cpu(), s.cpu())


def vllm_marlin_scales(scale_e4m3: torch.Tensor, scale_factor: float | None = None):
    """vLLM nvfp4_marlin_process_scales on an (unpermuted) [N, G] scale tensor, decoded back to the
    effective block scale s * scale_factor per entry; returns (values [N, G], scale_factor)."""
    out, sf = marlin_utils_fp4.nvfp4_marlin_process_scales(
        scale_e4m3.cpu().to(torch.bfloat16), scale_factor=scale_factor, a_dtype=torch.bfloat16
    )
    b = out.view(torch.uint8).to(torch.int32)
    # S0E5M3 byte: 5 exponent bits (bias 15, like fp16) and 3 mantissa bits, value = s*sf*2^7.
    e5, m3 = b >> 3, b & 7
    val = torch.where(e5 > 0, torch.exp2(e5.float() - 15) * (1 + m3.float() / 8), torch.zeros(()))
    val = (val / 128).reshape(-1, 4)[:, [0, 2, 1, 3]].reshape(scale_e4m3.shape)  # undo interleave
    return val, sf


# ---- independent references ------------------------------------------------------------------


def e4m3_rne(v: float) -> float:
    """Round a finite non-negative fp32 value to E4M3 (RNE, saturating at 448)."""
    if v >= 448.0:
        return 448.0
    if v == 0.0:
        return 0.0
    exp = max(math.frexp(v)[1] - 1, -6)  # below 2^-6 the step is fixed (subnormals)
    step = 2.0 ** (exp - 3)
    return round(v / step) * step  # Python's round() is half-to-even


def e2m1_rne(v: float) -> float:
    """Nearest E2M1 magnitude to v >= 0 (saturating at 6), ties to the even code."""
    v = min(v, 6.0)
    i = min(range(8), key=lambda j: (abs(E2M1_GRID[j] - v), j % 2))
    return E2M1_GRID[i]


def e2m1_code_rne(v: float) -> int:
    """E2M1 code of v (already clamped to [-6, 6]): sign bit for v < 0."""
    mag = E2M1_GRID.index(e2m1_rne(abs(v)))
    return mag | (8 if v < 0 else 0)
