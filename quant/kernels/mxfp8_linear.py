"""MXFP8 linears on Hopper (W8A16, ``quant.forms.mxfp8_linear(..., "hopper")``): forward and input
gradient against the exactly dequantized weight W = e4m3 * 2^(byte - 127), bf16 GEMMs with fp32
accumulation.

Two implementations:
- ``"dequant"`` (the default): a one-pass Triton dequantize into a bf16 buffer per call, then cuBLAS
  (``F.linear`` / ``mm``); the buffer is freed after the call and rebuilt in the backward, so the
  frozen base keeps 1 B/param resident;
- ``"fused"``: Triton kernels that read the e4m3 bytes and E8M0 scales and dequantize the tile in
  registers (1 byte/param of weight traffic, no bf16 buffer). Correct (same bounds as the other
  path in tests/quant/test_kernels_gpu.py) but slower everywhere measured, so never picked by
  default.

Measured on one H200 (torch 2.11, Triton 3.6; results/gpu/bench_mxfp8_linear.json), 8192x6144 and
6144x8192 weights, 512..16384 tokens, as a fraction of bf16 cuBLAS on a resident bf16 weight:
dequant+cuBLAS 0.63-0.64x at 512 tokens (the 0.04 ms dequantize dominates), 0.82-0.84x at 2048,
0.86-0.94x at 8192-16384, forward and input gradient alike; fused 0.21-0.26x forward and
0.35-0.45x input gradient (about 195 and 335 TFLOP/s). ``impl=None`` therefore uses "dequant"
(``AUTO_FUSED_MAX_ROWS = 0``). At the trainer's calls (every token of the batch, 64K-131K rows, the
q/k/v/o, indexer and shared-expert shapes of M3) dequant+cuBLAS is 0.98-1.03x bf16 (results/gpu/run11/
bench_mxfp8.json). On CPU (or without Triton) every call runs the ``quant.forms`` reference.

Scale bytes 0 and 255 follow ``quant.mxfp8.dequantize`` (2^-127, NaN); products that fall in the
fp32 subnormal range (scale bytes below ~10) may be flushed to zero by the GPU kernels, which no
real checkpoint has.
"""

import functools

import torch
import torch.nn.functional as F

from quant import forms, mxfp8
from quant._common import check_dtype
from quant.kernels._triton import triton_available

__all__ = ["AUTO_FUSED_MAX_ROWS", "mxfp8_dequantize", "mxfp8_linear", "mxfp8_linear_reference"]

BLOCK = 32
# impl=None uses the fused kernels up to this many rows (tokens) and dequant + cuBLAS above it; 0:
# the fused kernels lost at every measured size (see the module docstring).
AUTO_FUSED_MAX_ROWS = 0


@functools.lru_cache(maxsize=None)
def _kernels():
    # Triton is optional (CPU installs lack it): imported on the first launch on a CUDA tensor
    import triton
    import triton.language as tl

    @triton.jit
    def _e8m0(b):
        # uint8 E8M0 -> fp32 2^(b - 127); 0 -> 2^-127 (fp32 subnormal), 255 -> NaN.
        bi = b.to(tl.int32)
        v = (bi << 23).to(tl.float32, bitcast=True)
        v = tl.where(bi == 0, 5.877471754111438e-39, v)
        return tl.where(bi == 255, float("nan"), v)

    @triton.jit
    def _decode(q, s, R: tl.constexpr, BK: tl.constexpr):
        # q [R, BK] e4m3 bytes, s [R, BK/32] E8M0 bytes -> [R, BK] bf16 (exact).
        w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        w = tl.reshape(w, (R, BK // 32, 32)) * _e8m0(s)[:, :, None]
        return tl.reshape(w, (R, BK)).to(tl.bfloat16)

    @triton.jit
    def _dequant_kernel(q_ptr, s_ptr, out_ptr, total, BLOCK_E: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid.to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
        ok = offs < total
        q = tl.load(q_ptr + offs, mask=ok, other=0)
        s = tl.load(s_ptr + offs // 32, mask=ok, other=127)
        w = q.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _e8m0(s)
        tl.store(out_ptr + offs, w.to(tl.bfloat16), mask=ok)

    @triton.jit
    def _fwd_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr,
                    HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr):
        # y^T tile [BN, BM] = W[BN, K] @ x[BM, K]^T (weights on the MMA's M side).
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_n = tl.cdiv(N, BN)
        per_group = GROUP * num_m
        g = pid // per_group
        first_n = g * GROUP
        gsize = tl.minimum(num_n - first_n, GROUP)
        pid_n = first_n + (pid % per_group) % gsize
        pid_m = (pid % per_group) // gsize
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_n = pid_n * BN + tl.arange(0, BN)
        m_ok = offs_m < M
        n_ok = offs_n < N
        offs_k = tl.arange(0, BK)
        offs_s = tl.arange(0, BK // 32)
        KS = K // 32
        x_ptrs = x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :]
        q_ptrs = q_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
        s_ptrs = s_ptr + offs_n.to(tl.int64)[:, None] * KS + offs_s[None, :]
        acc = tl.zeros((BN, BM), dtype=tl.float32)
        for i in range(0, tl.cdiv(K, BK)):
            if EVEN_K:
                xt = tl.load(x_ptrs, mask=m_ok[:, None], other=0.0)
                q = tl.load(q_ptrs, mask=n_ok[:, None], other=0)
                s = tl.load(s_ptrs, mask=n_ok[:, None], other=127)
            else:
                k_ok = i * BK + offs_k < K
                xt = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
                q = tl.load(q_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0)
                s = tl.load(s_ptrs, mask=n_ok[:, None] & (i * (BK // 32) + offs_s < KS)[None, :], other=127)
            acc = tl.dot(_decode(q, s, BN, BK), tl.trans(xt), acc)
            x_ptrs += BK
            q_ptrs += BK
            s_ptrs += BK // 32
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[:, None]
        y_ptrs = y_ptr + offs_m.to(tl.int64)[None, :] * stride_ym + offs_n[:, None]
        tl.store(y_ptrs, acc.to(tl.bfloat16), mask=n_ok[:, None] & m_ok[None, :])

    @triton.jit
    def _dgrad_kernel(dy_ptr, q_ptr, s_ptr, dx_ptr, M, N, K, stride_dym, stride_dxm,
                      BM: tl.constexpr, BK: tl.constexpr, BN: tl.constexpr, GROUP: tl.constexpr,
                      EVEN_N: tl.constexpr, EVEN_K: tl.constexpr):
        # dx tile [BM, BK] = dy[BM, N] @ W[N, BK].
        pid = tl.program_id(0)
        num_m = tl.cdiv(M, BM)
        num_k = tl.cdiv(K, BK)
        per_group = GROUP * num_m
        g = pid // per_group
        first_k = g * GROUP
        gsize = tl.minimum(num_k - first_k, GROUP)
        pid_k = first_k + (pid % per_group) % gsize
        pid_m = (pid % per_group) // gsize
        offs_m = pid_m * BM + tl.arange(0, BM)
        offs_k = pid_k * BK + tl.arange(0, BK)
        offs_s = pid_k * (BK // 32) + tl.arange(0, BK // 32)
        m_ok = offs_m < M
        k_ok = offs_k < K
        s_ok = offs_s < K // 32
        offs_n = tl.arange(0, BN)
        KS = K // 32
        dy_ptrs = dy_ptr + offs_m.to(tl.int64)[:, None] * stride_dym + offs_n[None, :]
        q_ptrs = q_ptr + offs_n.to(tl.int64)[:, None] * K + offs_k[None, :]
        s_ptrs = s_ptr + offs_n.to(tl.int64)[:, None] * KS + offs_s[None, :]
        acc = tl.zeros((BM, BK), dtype=tl.float32)
        for i in range(0, tl.cdiv(N, BN)):
            r_ok = i * BN + offs_n < N
            if EVEN_N and EVEN_K:
                g_t = tl.load(dy_ptrs, mask=m_ok[:, None], other=0.0)
                q = tl.load(q_ptrs)
                s = tl.load(s_ptrs)
            else:
                g_t = tl.load(dy_ptrs, mask=m_ok[:, None] & r_ok[None, :], other=0.0)
                q = tl.load(q_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0)
                s = tl.load(s_ptrs, mask=r_ok[:, None] & s_ok[None, :], other=127)
            acc = tl.dot(g_t, _decode(q, s, BN, BK), acc)
            dy_ptrs += BN
            q_ptrs += BN * K
            s_ptrs += BN * KS
        dx_ptrs = dx_ptr + offs_m.to(tl.int64)[:, None] * stride_dxm + offs_k[None, :]
        tl.store(dx_ptrs, acc.to(tl.bfloat16), mask=m_ok[:, None] & k_ok[None, :])

    return triton, _dequant_kernel, _fwd_kernel, _dgrad_kernel


def fwd_config(m: int) -> dict:
    if m <= 64:
        return dict(BM=16, BN=128, BK=128, GROUP=8, num_warps=4, num_stages=4)
    if m <= 256:
        return dict(BM=64, BN=128, BK=128, GROUP=8, num_warps=4, num_stages=4)
    return dict(BM=128, BN=128, BK=64, GROUP=8, num_warps=8, num_stages=4)


def dgrad_config(m: int) -> dict:
    if m <= 256:
        return dict(BM=64, BK=128, BN=64, GROUP=8, num_warps=4, num_stages=4)
    return dict(BM=128, BK=128, BN=64, GROUP=8, num_warps=8, num_stages=3)


def _check(weight, scale):
    check_dtype(weight, "weight", torch.float8_e4m3fn)
    check_dtype(scale, "scale", torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8))
    if weight.ndim != 2 or weight.shape[1] % BLOCK != 0 or tuple(scale.shape) != (
        weight.shape[0], weight.shape[1] // BLOCK
    ):
        raise ValueError(
            f"weight {tuple(weight.shape)} and scale {tuple(scale.shape)}: expected [N, K] with K a "
            f"multiple of {BLOCK} and [N, K/{BLOCK}]"
        )


def mxfp8_dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """e4m3 [N, K] + E8M0 [N, K/32] -> bf16 [N, K]: one Triton pass on CUDA, else
    ``quant.mxfp8.dequantize`` (same values)."""
    _check(weight, scale)
    if not (weight.is_cuda and triton_available()):
        return mxfp8.dequantize(weight, scale.view(torch.uint8), torch.bfloat16)
    triton, dequant_kernel, _, _ = _kernels()
    q = weight.contiguous().view(torch.uint8)
    s = scale.contiguous().view(torch.uint8)
    out = torch.empty(weight.shape, dtype=torch.bfloat16, device=weight.device)
    total = q.numel()
    block = 4096
    dequant_kernel[(triton.cdiv(total, block),)](q, s, out, total, BLOCK_E=block, num_warps=8)
    return out


def _fused_fwd(x2, weight, scale, bias, config=None):
    triton, _, fwd_kernel, _ = _kernels()
    m, k = x2.shape
    n = weight.shape[0]
    cfg = dict(fwd_config(m), **(config or {}))
    out = torch.empty(m, n, dtype=torch.bfloat16, device=x2.device)
    if m == 0:
        return out
    q = weight.contiguous().view(torch.uint8)
    s = scale.contiguous().view(torch.uint8)
    b = bias.contiguous() if bias is not None else out
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(n, cfg["BN"]),)
    fwd_kernel[grid](
        x2, q, s, b, out, m, n, k, x2.stride(0), out.stride(0),
        BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], GROUP=cfg["GROUP"], HAS_BIAS=bias is not None,
        EVEN_K=(k % cfg["BK"] == 0), num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


def _fused_dgrad(dy2, weight, scale, config=None):
    triton, _, _, dgrad_kernel = _kernels()
    m, n = dy2.shape
    k = weight.shape[1]
    cfg = dict(dgrad_config(m), **(config or {}))
    out = torch.empty(m, k, dtype=torch.bfloat16, device=dy2.device)
    if m == 0:
        return out
    q = weight.contiguous().view(torch.uint8)
    s = scale.contiguous().view(torch.uint8)
    grid = (triton.cdiv(m, cfg["BM"]) * triton.cdiv(k, cfg["BK"]),)
    dgrad_kernel[grid](
        dy2, q, s, out, m, n, k, dy2.stride(0), out.stride(0),
        BM=cfg["BM"], BK=cfg["BK"], BN=cfg["BN"], GROUP=cfg["GROUP"],
        EVEN_N=(n % cfg["BN"] == 0), EVEN_K=(k % cfg["BK"] == 0),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return out


class _MXFP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, scale, bias, impl, config):  # noqa: D102
        ctx.save_for_backward(weight, scale)
        ctx.impl = impl
        if impl == "fused":
            return _fused_fwd(x2, weight, scale, bias, config)
        w = mxfp8_dequantize(weight, scale)
        return F.linear(x2, w, bias)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        weight, scale = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            g = grad.to(torch.bfloat16).contiguous()
            if ctx.impl == "fused":
                gx = _fused_dgrad(g, weight, scale)
            else:
                gx = g @ mxfp8_dequantize(weight, scale)
        return gx, None, None, None, None, None


def mxfp8_linear_reference(x, weight, scale, bias=None):
    """``quant.forms.mxfp8_linear(x, weight, scale, "hopper", bias=bias)``."""
    return forms.mxfp8_linear(x, weight, scale.view(torch.uint8), "hopper", bias=bias)


def mxfp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    impl: str | None = None,
    config: dict | None = None,
) -> torch.Tensor:
    """MXFP8 linear x [..., K] bf16 -> [..., N] bf16 in the hopper serving form; frozen weight
    (e4m3 [N, K], E8M0 uint8 [N, K/32]) and bias, differentiable in x.

    ``impl``: "dequant" (bf16 buffer per call + cuBLAS), "fused" (dequant-fused Triton kernels) or
    None (fused up to ``AUTO_FUSED_MAX_ROWS`` rows, i.e. "dequant" as measured). On CPU or without
    Triton: the reference.
    """
    _check(weight, scale)
    if x.shape[-1] != weight.shape[1]:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [..., {weight.shape[1]}]")
    if not (x.is_cuda and triton_available()):
        return mxfp8_linear_reference(x, weight, scale, bias)
    if impl not in (None, "fused", "dequant"):
        raise ValueError(f"unknown impl {impl!r}; expected 'fused', 'dequant' or None")
    x2 = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
    if impl is None:
        impl = "fused" if x2.shape[0] <= AUTO_FUSED_MAX_ROWS else "dequant"
    b = None if bias is None else bias.detach().to(torch.bfloat16)
    y = _MXFP8Linear.apply(x2, weight, scale.view(torch.uint8), b, impl, config)
    return y.reshape(*x.shape[:-1], weight.shape[0])
