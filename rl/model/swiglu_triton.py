"""M3's MoE activation (SwiGLU-OAI, m3.ops.swigluoai_uninterleave) as one Triton kernel each way on CUDA.

The eager expression runs seven bf16 elementwise kernels forward (two clamps, alpha*gate, sigmoid, two products,
up+beta) and autograd keeps their outputs for a backward of as many again: at 4 x 16K tokens of M3 they took more GPU
time than the NVFP4 weight decode (results/gpu/run28). The forward kernel repeats the eager chain's rounding points:
every step is computed in fp32 from bf16 operands and rounded to bf16 where the eager op stores its output (torch's
CUDA elementwise ops compute bf16 in fp32 "opmath": clamp as min/max, x*alpha with alpha in fp32, sigmoid as
1 / (1 + expf(-x)) with IEEE division), so the output is bit-identical to the eager expression on the same GPU
(tests/rl/model/test_swiglu_triton.py, every bf16 gate value). Backward saves only gate_up (bf16) and forms both
halves' gradients in fp32 in one pass.
"""

import os

import torch

from m3.ops import swigluoai_uninterleave

try:  # CPU installs run without Triton; the eager expression is the path there
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover
    triton = None

BLOCK_R, BLOCK_C = 4, 1024
# CUDA's expf (libdevice); Triton's CPU interpreter (the CPU tests) has no libdevice and takes numpy's exp
EXPF = os.environ.get("TRITON_INTERPRET") != "1"


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float, beta: float) -> torch.Tensor:
    """swigluoai_uninterleave(gate_up, alpha, limit, beta): the fused kernels for bf16 on CUDA, else the eager ops."""
    if triton is None or not gate_up.is_cuda or gate_up.dtype != torch.bfloat16:
        return swigluoai_uninterleave(gate_up, alpha, limit, beta)
    return _SwiGLU.apply(gate_up, float(alpha), float(limit), float(beta))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up, alpha, limit, beta):  # noqa: D102
        gu = gate_up.reshape(-1, gate_up.shape[-1]).contiguous()
        rows, inter = gu.shape[0], gu.shape[1] // 2
        out = torch.empty(rows, inter, dtype=gu.dtype, device=gu.device)
        _fwd[_grid(rows, inter)](gu, out, rows, inter, alpha, limit, beta, EXPF, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
        ctx.save_for_backward(gu)
        ctx.args, ctx.shape = (alpha, limit, beta), gate_up.shape
        return out.view(*gate_up.shape[:-1], inter)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g_out):  # noqa: D102
        (gu,) = ctx.saved_tensors
        rows, inter = gu.shape[0], gu.shape[1] // 2
        g = g_out.reshape(rows, inter).contiguous()
        g_gu = torch.empty_like(gu)
        _bwd[_grid(rows, inter)](gu, g, g_gu, rows, inter, *ctx.args, EXPF, BLOCK_R=BLOCK_R, BLOCK_C=BLOCK_C)
        return g_gu.view(ctx.shape), None, None, None


def _grid(rows, inter):
    return (triton.cdiv(rows, BLOCK_R), triton.cdiv(inter, BLOCK_C))


if triton is not None:
    @triton.jit
    def round_bf16(x):
        """fp32 rounded to bf16 (nearest, ties to even) and back: where an eager bf16 op stores its output. In
        integer ops, as cvt.rn does it on the GPU, because Triton's CPU interpreter truncates in casts."""
        u = x.to(tl.uint32, bitcast=True)
        u = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
        return tl.where(x != x, x, u.to(tl.float32, bitcast=True))

    @triton.jit
    def _tile(pid_r, pid_c, rows, inter, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
        r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
        c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (r[:, None] < rows) & (c[None, :] < inter)
        return r[:, None].to(tl.int64) * (2 * inter) + c[None, :], r[:, None].to(tl.int64) * inter + c[None, :], mask

    @triton.jit
    def _clamped(gate, up, limit):
        # torch's clamp propagates NaN; min/max alone would drop it
        g = tl.where(gate != gate, gate, tl.minimum(gate, limit))
        u = tl.where(up != up, up, tl.minimum(tl.maximum(up, -limit), limit))
        return g, u

    @triton.jit
    def _sigmoid(x, EXPF: tl.constexpr):
        e = libdevice.exp(-x) if EXPF else tl.exp(-x)
        return round_bf16(tl.math.div_rn(1.0, 1.0 + e))

    @triton.jit
    def _fwd(gu_ptr, out_ptr, rows, inter, alpha, limit, beta, EXPF: tl.constexpr, BLOCK_R: tl.constexpr,
             BLOCK_C: tl.constexpr):
        src, dst, mask = _tile(tl.program_id(0), tl.program_id(1), rows, inter, BLOCK_R, BLOCK_C)
        gate = tl.load(gu_ptr + src, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + src + inter, mask=mask, other=0.0).to(tl.float32)
        g, u = _clamped(gate, up, limit)
        s = _sigmoid(round_bf16(g * alpha), EXPF)
        out = round_bf16(round_bf16(g * s) * round_bf16(u + beta))
        tl.store(out_ptr + dst, out.to(tl.bfloat16), mask=mask)

    @triton.jit
    def _bwd(gu_ptr, g_ptr, g_gu_ptr, rows, inter, alpha, limit, beta, EXPF: tl.constexpr, BLOCK_R: tl.constexpr,
             BLOCK_C: tl.constexpr):
        src, dst, mask = _tile(tl.program_id(0), tl.program_id(1), rows, inter, BLOCK_R, BLOCK_C)
        gate = tl.load(gu_ptr + src, mask=mask, other=0.0).to(tl.float32)
        up = tl.load(gu_ptr + src + inter, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(g_ptr + dst, mask=mask, other=0.0).to(tl.float32)
        g, u = _clamped(gate, up, limit)
        s = _sigmoid(round_bf16(g * alpha), EXPF)
        # out = g * s(alpha g) * (u + beta); clamp passes the gradient where the input is within its limits
        d_g = grad * (u + beta) * (s + g * alpha * s * (1.0 - s))
        d_u = grad * g * s
        d_g = tl.where(gate <= limit, d_g, 0.0)
        d_u = tl.where((up >= -limit) & (up <= limit), d_u, 0.0)
        tl.store(g_gu_ptr + src, round_bf16(d_g).to(tl.bfloat16), mask=mask)
        tl.store(g_gu_ptr + src + inter, round_bf16(d_u).to(tl.bfloat16), mask=mask)
