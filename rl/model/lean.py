"""Memory-lean autograd functions for the trainer's per-token fp32 math: the same forward values as the plain torch
expressions they replace, computed in row chunks, saving only activation-dtype inputs (and per-row scalars) for
backward, which recomputes the fp32 intermediates chunk by chunk.

Why: autograd on `x.float() ...` keeps fp32 copies of [T, H] activations (4 B per element) and runs every fp32
intermediate at full T. At 8 x 16K tokens of M3 one fp32 [T, 6144] tensor is 3.2 GB and [T, 8192] 4.3 GB; the fused
add-norms, q/k norm + RoPE, LoRA shrinks and the router held ~20 of them at once in one layer's backward
(results/gpu/issue19_targets.json). Gradients follow the same rounding points as autograd's (casts to the activation
dtype where the forward casts), with fp32 sums in another order.
"""

import torch

from rl.model import lean_triton, lm_head_triton

ROWS = 8192  # rows per chunk: an fp32 [8192, 8192] intermediate is 256 MB


def row_chunks(n: int):
    return ((a, min(a + ROWS, n)) for a in range(0, n, ROWS))


def _rms(xf: torch.Tensor, eps: float) -> torch.Tensor:
    return torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)


def _rms_backward(g: torch.Tensor, xf: torch.Tensor, rs: torch.Tensor) -> torch.Tensor:
    """d/dxf of xf * rs(xf) given the gradient g of that product (rs = rsqrt(mean(xf^2) + eps))."""
    return g * rs - xf * (rs.pow(3) * (g * xf).mean(-1, keepdim=True))


class _AddNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, w1, eps):  # noqa: D102
        normed, res = torch.empty_like(x), torch.empty_like(x)
        rs = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
        for a, b in row_chunks(x.shape[0]):
            total = x[a:b].float() + residual[a:b]  # the fp32 operand promotes the other: one cast pass fewer
            rs[a:b] = _rms(total, eps)
            torch.mul(total * rs[a:b], w1, out=normed[a:b])  # fp32 product rounded once on the store, no copy
            res[a:b] = total
        ctx.save_for_backward(x, residual, w1, rs)
        return normed, res

    @staticmethod
    def backward(ctx, g_normed, g_res):  # noqa: D102
        x, residual, w1, rs = ctx.saved_tensors
        if lean_triton.usable(x):
            gx = lean_triton.add_norm_backward(*(t if t is None else t.contiguous()
                                                 for t in (x, residual, w1, rs, g_normed, g_res)))
            return gx, gx.to(residual.dtype), None, None
        gx = torch.empty_like(x)
        for a, b in row_chunks(x.shape[0]):
            rows = (None if t is None else t[a:b] for t in (g_normed, g_res))
            gx[a:b] = _add_norm_grad(x[a:b], residual[a:b], w1, rs[a:b], *rows)
        return gx, gx.to(residual.dtype), None, None


def _add_norm_grad(x, residual, w1, rs, g_normed, g_res):
    """fp32 gradient of (normed, residual) w.r.t. x (= w.r.t. residual) for rows of _AddNorm's saved tensors and the
    incoming gradients (either may be None)."""
    total = x.float() + residual.float()
    g = _rms_backward(g_normed.float() * w1, total, rs) if g_normed is not None else 0.0
    return g + g_res.float() if g_res is not None else g


def fused_add_norm(norm, x: torch.Tensor, residual: torch.Tensor):
    """vLLM's fused add + Gemma norm: the residual is stored in the activation dtype, the norm reads the fp32 sum.
    Returns (normed, residual), both in x's dtype."""
    return _AddNorm.apply(x, residual, 1.0 + norm.weight.float(), norm.eps)


def _rope(xf, cos, sin, half, rot, sign):
    """NeoX rotation of the first `rot` channels of fp32 xf [N, heads, D]; sign -1 applies the inverse (transpose)."""
    x1, x2 = xf[..., :half], xf[..., half:rot]
    s = sin * sign
    return torch.cat([x1 * cos - x2 * s, x2 * cos + x1 * s, xf[..., rot:]], dim=-1)


class _NormRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w1, eps, cos_sin, rot):  # noqa: D102
        out = torch.empty_like(x)
        rs = torch.empty(*x.shape[:-1], 1, dtype=torch.float32, device=x.device)
        half = rot // 2
        for a, b in row_chunks(x.shape[0]):
            xf = x[a:b].float()
            rs[a:b] = _rms(xf, eps)
            normed = (xf * rs[a:b] * w1).to(x.dtype)  # the norm's output is stored in the activation dtype
            cos, sin = cos_sin[a:b, None, :half].float(), cos_sin[a:b, None, half:rot].float()
            out[a:b] = _rope(normed.float(), cos, sin, half, rot, 1.0)
        ctx.save_for_backward(x, w1, cos_sin, rs)
        ctx.eps, ctx.rot = eps, rot
        return out

    @staticmethod
    def backward(ctx, g_out):  # noqa: D102
        x, w1, cos_sin, rs = ctx.saved_tensors
        if lean_triton.usable(x):
            return (lean_triton.norm_rope_backward(x.contiguous(), w1.contiguous(), rs, cos_sin.contiguous(), ctx.rot,
                                                   g_out.contiguous()), None, None, None, None)
        gx = torch.empty_like(x)
        for a, b in row_chunks(x.shape[0]):
            gx[a:b] = _norm_rope_grad(x[a:b], w1, rs[a:b], cos_sin[a:b], ctx.rot, g_out[a:b])
        return gx, None, None, None, None


def _norm_rope_grad(x, w1, rs, cos_sin, rot, g_out):
    """fp32 gradient of norm_rope w.r.t. rows x [N, heads, D] given g_out: the rotation undone, rounded to x's dtype
    where the forward stores the norm, then the norm's gradient."""
    half = rot // 2
    cos, sin = cos_sin[:, None, :half].float(), cos_sin[:, None, half:rot].float()
    g_normed = _rope(g_out.float(), cos, sin, half, rot, -1.0).to(x.dtype)
    return _rms_backward(g_normed.float() * w1, x.float(), rs)


def norm_rope(norm, x: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Gemma norm over the last dim of x [N, heads, D], stored in x's dtype, then partial NeoX RoPE in fp32
    (m3.ops.neox_rope): vLLM's q/k norm + RoPE. cos_sin [N, rotary_dim] in the model dtype."""
    return _NormRope.apply(x, 1.0 + norm.weight.float(), norm.eps, cos_sin, rotary_dim)


class _Fp32Rows(torch.autograd.Function):
    """fp32(x) @ w^T for a frozen fp32 w (the router's GateLinear), saving nothing of x."""

    @staticmethod
    def forward(ctx, x, w):  # noqa: D102
        out = torch.empty(*x.shape[:-1], w.shape[0], dtype=torch.float32, device=x.device)
        for a, b in row_chunks(x.shape[0]):
            out[a:b] = x[a:b].float() @ w.t()
        ctx.save_for_backward(w)
        ctx.dtype = x.dtype
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        (w,) = ctx.saved_tensors
        gx = torch.empty(*g.shape[:-1], w.shape[1], dtype=ctx.dtype, device=g.device)
        for a, b in row_chunks(g.shape[0]):
            gx[a:b] = g[a:b] @ w
        return gx, None


def fp32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, in] (any float dtype) @ frozen fp32 w [out, in]^T in fp32: [N, out]."""
    return _Fp32Rows.apply(x, w)


class _AddRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, index, src):  # noqa: D102
        ctx.mark_dirty(out)
        ctx.save_for_backward(index)
        return out.index_add_(0, index, src)

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        (index,) = ctx.saved_tensors
        return g, None, g.index_select(0, index)


def add_rows_(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """out.index_add_(0, index, src), keeping only the index for backward: autograd's index_add_ also keeps src
    (for its shape), which for the routed experts' weighted rows is fp32 [T * top_k, H], 13 GB per M3 layer at 131K
    tokens."""
    return _AddRows.apply(out, index, src)


LOGIT_ROWS = 1024  # rows per logits chunk: fp32 [1024, vocab] is 0.8 GB for M3


class _LMHeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, w, targets):  # noqa: D102
        out = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        jac = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        for a in range(0, h.shape[0], LOGIT_ROWS):
            b, t = a + LOGIT_ROWS, targets[a:a + LOGIT_ROWS, None]
            logits = h[a:b] @ w.t()
            if lm_head_triton.usable(logits):  # the same math in one kernel; d written over the logits
                out[a:b] = lm_head_triton.logprobs_(logits, t[:, 0], jac is not None)
                d = logits
            else:
                logp = logits.float().log_softmax(-1)
                out[a:b] = logp.gather(1, t)[:, 0]
                if jac is not None:  # -d lp[t] / d logits = softmax - onehot, in the logits' dtype as autograd casts
                    d = logp.exp_().scatter_add_(1, t, torch.full(t.shape, -1.0, dtype=logp.dtype, device=t.device))
                    d = d.to(h.dtype)
            if jac is not None:
                jac[a:b] = d @ w  # the negated Jacobian (rounding is sign-symmetric): no negation pass
        ctx.save_for_backward(jac)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # noqa: D102
        (jac,) = ctx.saved_tensors
        gh = torch.empty_like(jac)
        for a, b in row_chunks(jac.shape[0]):
            torch.mul(jac[a:b], -g[a:b, None], out=gh[a:b])  # in fp32 (g's dtype), rounded once on the store
        return gh, None, None


def lm_head_logprobs(h: torch.Tensor, lm_head: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log_softmax(fp32(h @ lm_head^T))[targets] per row (vLLM's logprobs: the logits GEMM in the model dtype, the
    softmax in fp32), chunked over rows; fp32 [rows].

    Each row's logprob depends on that row of h alone, so its gradient is g[row] times the row's Jacobian
    (onehot(t) - softmax) @ lm_head. When h needs a gradient the forward forms that Jacobian from the softmax it
    already holds and keeps it [rows, H] in h's dtype (instead of h): two logits-size GEMMs per row, where recomputing
    the logits in backward took three (at M3's vocab 200064 one of them costs about three layers' forward). On CUDA
    the softmax work between the two GEMMs is one kernel (rl.model.lm_head_triton)."""
    return _LMHeadLogprobs.apply(h, lm_head, targets)


def _weighted_rows_grad(g, y, w):
    """Gradients of fp32(y) * w[:, None] (rows y [R, H], fp32 w [R]) given its fp32 gradient g."""
    return (g * w[:, None]).to(y.dtype), (g * y.float()).sum(-1)


class _WeightedRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w):  # noqa: D102
        out = torch.empty(y.shape, dtype=torch.float32, device=y.device)
        for a, b in row_chunks(y.shape[0]):  # fp32 w promotes: fp32(y) * w in one pass, no fp32(y) copy
            torch.mul(y[a:b], w[a:b, None].float(), out=out[a:b])
        ctx.save_for_backward(y, w)
        return out

    @staticmethod
    def backward(ctx, g):  # noqa: D102
        y, w = ctx.saved_tensors
        if lean_triton.usable(y):
            return lean_triton.weighted_rows_backward(g.contiguous(), y.contiguous(), w.contiguous())
        gy, gw = torch.empty_like(y), torch.empty_like(w)
        for a, b in row_chunks(y.shape[0]):
            gy[a:b], gw[a:b] = _weighted_rows_grad(g[a:b], y[a:b], w[a:b])
        return gy, gw


def weighted_rows(y: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32(y) * w[:, None] in row chunks, saving y in its own dtype (autograd's mul would keep fp32(y))."""
    return _WeightedRows.apply(y, w)


class _WeightedSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, w, tok, num_tokens):  # noqa: D102
        out = torch.zeros(num_tokens, y.shape[1], dtype=torch.float32, device=y.device)
        for a, b in row_chunks(y.shape[0]):
            out.index_add_(0, tok[a:b], y[a:b] * w[a:b, None].float())  # fp32 w promotes: no fp32(y) copy
        ctx.save_for_backward(y, w, tok)
        return out

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        y, w, tok = ctx.saved_tensors
        gy, gw = torch.empty_like(y), torch.empty_like(w)
        for a, b in row_chunks(y.shape[0]):
            gy[a:b], gw[a:b] = _weighted_rows_grad(grad[tok[a:b]], y[a:b], w[a:b])
        return gy, gw, None, None


def weighted_sum(y: torch.Tensor, w: torch.Tensor, tok: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Routed rows y [R, H] with weights w [R] (fp32) summed into their tokens tok [R]: fp32 [num_tokens, H]
    (out[t] = sum over the rows r of token t of fp32(y[r]) * w[r]). Saves y in its own dtype and rebuilds the
    products in row chunks: autograd's mul would keep fp32(y), 4 B per routed row element (13 GB per M3 layer at
    64K tokens), and the unchunked product as much again transiently."""
    return _WeightedSum.apply(y, w, tok, num_tokens)
