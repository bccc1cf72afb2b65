"""Serving forms of the quantized linears as pure-torch functions, so the trainer's forward matches what vLLM
runs; the reference every ``quant.kernels`` fast path matches, and what those fall back to on CPU.

Profiles:
- ``"hopper"`` -- what vLLM 0.33 runs on H100/H200 (Humming by default, Marlin with LoRA), and the
  form to use whenever LoRA is on. NVFP4 experts are W4A16: the weight enters the GEMM as
  e2m1 * s (exact in bf16) and the global scale multiplies the fp32 accumulator,
  y = RNE_dtype(fp32acc(x @ (e2m1*s)^T) * gs_dec). MXFP8 linears are W8A16: a plain GEMM on the
  exactly dequantized weight.
- ``"blackwell"`` -- sm100 W4A4 / W8A8: additionally NVFP4 QDQ of the expert input (static global
  input scale, vLLM's activation QDQ formula) and MXFP8 QDQ of the linear input, each with a
  straight-through backward.

Weights are frozen buffers; gradients flow to x only. ``dtype`` is the computation (model) dtype:
bf16 normally, fp32 for fp32 models (same order of operations, no bf16 rounding). GEMM outputs
match vLLM's kernels only up to fp32 accumulation order; everything before the GEMM is bit-exact.

The frozen modules holding checkpoint tensors (``NVFP4Linear``, ``MXFP8Linear``) are in ``quant.serving``, which
also re-exports these functions.
"""

from __future__ import annotations

import warnings
from typing import Literal

import torch
import torch.nn.functional as F

from quant import mxfp8, nvfp4
from quant._common import E4M3_MAX, check_dtype

Profile = Literal["hopper", "blackwell"]
PROFILES: tuple[str, ...] = ("hopper", "blackwell")

__all__ = [
    "PROFILES",
    "check_profile",
    "fused_w13_global_scale",
    "marlin_flush_scales",
    "marlin_scale_factor",
    "mxfp8_act_qdq",
    "mxfp8_linear",
    "nvfp4_act_qdq",
    "nvfp4_linear",
    "nvfp4_weight",
]


def check_profile(profile: str) -> str:
    if profile not in PROFILES:
        raise ValueError(f"unknown serving profile {profile!r}; expected one of {PROFILES}")
    return profile


# ---------------------------------------------------------------------------------------------
# Activation fake-quant with straight-through gradients


class _NVFP4ActQDQ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, gs_enc: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return nvfp4.qdq_activation(x, gs_enc)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return grad, None


class _MXFP8ActQDQ(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return mxfp8.qdq(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: D102
        return (grad,)


def nvfp4_act_qdq(x: torch.Tensor, global_scale_enc: float | torch.Tensor) -> torch.Tensor:
    """NVFP4 QDQ of an activation [..., K] with a static encode global scale; STE backward.

    vLLM's encode scale for ModelOpt checkpoints is ``nvfp4.enc_from_dec(input_scale.max())``;
    for compressed-tensors MoE it is ``enc_from_dec(dec_from_enc(input_global_scale).max())``
    (vLLM inverts twice, which is not always the identity in fp32).
    """
    gs = torch.as_tensor(global_scale_enc, dtype=torch.float32, device=x.device)
    return _NVFP4ActQDQ.apply(x, gs)


def mxfp8_act_qdq(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 QDQ of an activation [..., K] (dynamic per-32 E8M0 scale); STE backward."""
    return _MXFP8ActQDQ.apply(x)


# ---------------------------------------------------------------------------------------------
# GEMM with the global scale on the fp32 accumulator

_MM_OUT_DTYPE_OK: bool | None = None


def _cuda_mm_out_dtype_ok() -> bool:
    """Whether this torch has the CUDA ``mm(..., out_dtype=float32)`` overload (probed once)."""
    global _MM_OUT_DTYPE_OK
    if _MM_OUT_DTYPE_OK is None:
        a = torch.ones(1, 1, dtype=torch.bfloat16, device="cuda")
        try:
            _MM_OUT_DTYPE_OK = torch.mm(a, a, out_dtype=torch.float32).dtype == torch.float32
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_OUT_DTYPE_OK = False
    return _MM_OUT_DTYPE_OK


def _mm_fp32(a: torch.Tensor, b_t: torch.Tensor) -> torch.Tensor:
    """fp32-accumulated a @ b_t.T with exact products for bf16/fp16 operands.

    On CUDA, ``torch.mm(..., out_dtype=float32)`` keeps the tensor-core speed and returns the fp32
    accumulator unrounded. Elsewhere (CPU, or a torch without it) both operands are upcast; bf16 and
    fp16 values fit TF32 exactly, so even with TF32 enabled the products stay exact.
    """
    low = (torch.bfloat16, torch.float16)
    if a.is_cuda and a.dtype in low and a.dtype == b_t.dtype and _cuda_mm_out_dtype_ok():
        return torch.mm(a, b_t.t(), out_dtype=torch.float32)
    return a.to(torch.float32) @ b_t.to(torch.float32).t()


class _NVFP4Matmul(torch.autograd.Function):
    """y = RNE_dtype(fp32acc(x @ (e2m1*s)^T) * gs); dx = RNE_dtype(fp32acc(dy @ (e2m1*s)) * gs). The weight is
    frozen and only its packed bytes are kept for backward (the dequantized copy is rebuilt there): saving the
    dtype weight would make the quantized base cost as much activation memory as a bf16 one."""

    @staticmethod
    def forward(ctx, x, packed, scale, gs, dtype):  # noqa: D102
        ctx.save_for_backward(packed, scale, gs)
        ctx.dtype = dtype
        return (_mm_fp32(x, nvfp4_weight(packed, scale, dtype)) * gs).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        packed, scale, gs = ctx.saved_tensors
        w = nvfp4_weight(packed, scale, ctx.dtype)
        return (_mm_fp32(grad.to(w.dtype), w.t()) * gs).to(w.dtype), None, None, None, None


class _MXFP8Matmul(torch.autograd.Function):
    """x @ dequant(W)^T (+ bias, added before the one rounding, as the GEMM epilogue does) with the E4M3 bytes and
    E8M0 scales kept for backward, not the dtype weight."""

    @staticmethod
    def forward(ctx, x, weight, scale, bias, dtype):  # noqa: D102
        ctx.save_for_backward(weight, scale)
        ctx.dtype = dtype
        return F.linear(x, mxfp8.dequantize(weight, scale, dtype), bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        weight, scale = ctx.saved_tensors
        return grad @ mxfp8.dequantize(weight, scale, ctx.dtype), None, None, None, None


# ---------------------------------------------------------------------------------------------
# NVFP4 experts


def marlin_scale_factor(scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> float:
    """Power of two Marlin multiplies the block scales by (and divides gs by) at load time.

    It is the largest 2^n with max_nonzero(s) * 2^n <= 448, taken over the *whole* tensor passed:
    vLLM shares one factor across all experts of a w13 or w2 stack, so pass the stack. fp16
    activations use 1 (vLLM skips the rescale for half).
    """
    if dtype == torch.float16:
        return 1.0
    s = scale.view(torch.float8_e4m3fn).to(torch.float32)
    nz = s[s > 0]
    if nz.numel() == 0:
        return 1.0
    top = float(nz.max())
    factor = 1.0
    while top * factor * 2 <= E4M3_MAX:
        factor *= 2
    return factor


def marlin_flush_scales(
    scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16, scale_factor: float | None = None
) -> torch.Tensor:
    """Block scales as Marlin sees them: those with s * scale_factor * 2^7 < 2 become 0.

    Marlin stores scale * 2^7 in an S0E5M3 byte that has no subnormals, so block scales below
    2^-6 / scale_factor are lost (with scale_factor 1: the E4M3 subnormals 0x01-0x07). Pass the
    whole w13 or w2 stack so the factor is the stack's (vLLM ``nvfp4_marlin_process_scales``).
    """
    check_dtype(scale, "scale", torch.float8_e4m3fn, torch.uint8)
    if scale_factor is None:
        scale_factor = marlin_scale_factor(scale, dtype)
    s = scale.view(torch.float8_e4m3fn)
    keep = s.to(torch.float32) * (scale_factor * 2.0**7) >= 2.0
    return torch.where(keep, s.view(torch.uint8), 0).to(torch.uint8).view(torch.float8_e4m3fn)


def fused_w13_global_scale(gs_w1: torch.Tensor, gs_w3: torch.Tensor) -> torch.Tensor:
    """Global scale vLLM applies to a fused gate|up (w13) weight: the gate's (w1's), per expert.

    When w1 and w3 were quantized with different global scales vLLM only warns, and the up half is
    mis-scaled by gs_w1 / gs_w3; the trainer must reproduce that to match the rollouts.
    """
    if not torch.allclose(gs_w1.float(), gs_w3.float()):
        warnings.warn("w1 and w3 global scales differ; vLLM uses w1's for the fused w13", stacklevel=2)
    return gs_w1


def nvfp4_weight(
    packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """e2m1 * s as a [N, K] tensor of ``dtype``: exact in bf16, fp16 and fp32 (no global scale)."""
    return nvfp4.dequantize(packed, scale, 1.0, dtype)


def nvfp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale_dec: float | torch.Tensor,
    profile: Profile = "hopper",
    *,
    input_global_scale_enc: float | torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """NVFP4 expert linear x [..., K] -> [..., N] in the serving form of ``profile``.

    ``packed`` [N, K/2], ``scale`` [N, K/16] (apply ``marlin_flush_scales`` beforehand to emulate
    Marlin), ``global_scale_dec`` the decode global scale (w13: the gate's, see
    ``fused_w13_global_scale``). ``input_global_scale_enc`` is required for "blackwell".

    The global scale goes on the fp32 accumulator (Marlin ``c *= global_scale``, Humming's
    epilogue), not into the weight as vLLM's emulation path does; the two orders differ in about
    a third of bf16 outputs.
    """
    check_profile(profile)
    dtype = dtype or x.dtype
    if packed.ndim != 2:
        raise ValueError(f"packed has shape {tuple(packed.shape)}; expected [N, K/2]")
    k = packed.shape[-1] * 2
    if x.shape[-1] != k:
        raise ValueError(
            f"x has shape {tuple(x.shape)}; expected [..., {k}] to match packed {tuple(packed.shape)}"
        )
    x = x.to(dtype)
    if profile == "blackwell":
        if input_global_scale_enc is None:
            raise ValueError("profile 'blackwell' needs input_global_scale_enc (static activation scale)")
        x = nvfp4_act_qdq(x, input_global_scale_enc)
    gs = torch.as_tensor(global_scale_dec, dtype=torch.float32, device=x.device)
    if gs.numel() != 1:
        raise ValueError(f"global_scale_dec has shape {tuple(gs.shape)}; expected one element per linear")
    y = _NVFP4Matmul.apply(x.reshape(-1, k), packed, scale, gs.reshape(()), dtype)
    return y.reshape(*x.shape[:-1], packed.shape[0])


# ---------------------------------------------------------------------------------------------
# MXFP8 linears


def mxfp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    profile: Profile = "hopper",
    *,
    bias: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """MXFP8 linear x [..., K] -> [..., N]; ``weight`` e4m3 [N, K], ``scale`` E8M0 uint8 [N, K/32].

    "hopper": W8A16, a dtype GEMM on the exactly dequantized weight (Humming/Marlin convert
    e8m0 -> bf16 exactly). "blackwell": the input is first MXFP8-QDQ'd (W8A8; products of two
    MXFP8 values are exact, so only accumulation order differs from the FP8 tensor-core GEMM).
    """
    check_profile(profile)
    dtype = dtype or x.dtype
    if weight.ndim != 2 or x.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"x has shape {tuple(x.shape)} and weight {tuple(weight.shape)}; expected [..., K] and [N, K]"
        )
    x = x.to(dtype)
    if profile == "blackwell":
        x = mxfp8_act_qdq(x)
    return _MXFP8Matmul.apply(x, weight, scale, None if bias is None else bias.to(dtype), dtype)
