"""rl.model.lean's per-row backward passes as one Triton kernel each on CUDA: the fused add + Gemma RMSNorm
(fused_add_norm), the q/k norm + RoPE (norm_rope) and the routed experts' weighted rows (weighted_rows).

The torch backwards run a chain of fp32 elementwise kernels per row chunk (casts, products, the norm's gradient, the
row sums): at 4 x 16K tokens of M3 they were the largest unlabelled block of the step (results/gpu/run29, run30
time splits, "other_backward"). One program per row reads the bf16/fp32 inputs once and writes the gradients once.
The forwards stay torch's: their values must equal the eager ops' bit for bit (the norm's reduction order is
torch's).

Same math and rounding points as the torch backwards (fp32 from the stored inputs, one rounding to the activation
dtype); row sums run in another order (tests/rl/model/test_lean_triton.py).
"""

import torch

try:  # CPU installs run without Triton; the torch backwards are the path there
    import triton
    import triton.language as tl

    from rl.model.swiglu_triton import round_bf16
except ImportError:  # pragma: no cover
    triton = None


def usable(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda


def add_norm_backward(x, residual, w1, rs, g_normed, g_res) -> torch.Tensor:
    """Gradient of (normed, residual) = (total * rs(total) * w1, total), total = fp32(x) + fp32(residual), w.r.t. x
    (= w.r.t. residual), in x's dtype. x, residual [N, H]; w1 fp32 [H]; rs fp32 [N, 1]; g_normed / g_res [N, H] or
    None."""
    rows, h = x.shape
    gx = torch.empty_like(x)
    dummy = x  # never read: the HAS_* flags drop the loads
    _add_norm_bwd[(rows,)](x, residual, w1, rs, g_normed if g_normed is not None else dummy,
                           g_res if g_res is not None else dummy, gx, h, HAS_GN=g_normed is not None,
                           HAS_GR=g_res is not None, BLOCK=triton.next_power_of_2(h), num_warps=8)
    return gx


def norm_rope_backward(x, w1, rs, cos_sin, rot, g_out) -> torch.Tensor:
    """Gradient of rope(bf16(x * rs(x) * w1)) w.r.t. x [N, heads, D] given g_out (the rotation of the first `rot`
    channels undone, rounded to x's dtype as the forward stores the norm, then the norm's gradient per head).
    w1 fp32 [D]; rs fp32 [N, heads, 1]; cos_sin [N, >= rot] (cos of the rot/2 frequencies, then their sin)."""
    rows, heads, d = x.shape
    gx = torch.empty_like(x)
    _norm_rope_bwd[(rows,)](x, w1, rs, cos_sin, g_out, gx, heads, d, rot // 2, rot, cos_sin.stride(0),
                            TO_BF16=x.dtype == torch.bfloat16, BLOCK_H=triton.next_power_of_2(heads),
                            BLOCK_D=triton.next_power_of_2(d), num_warps=8)
    return gx


def weighted_rows_backward(g, y, w) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of fp32(y) * w[:, None] given its fp32 gradient g [R, H]: (g * w in y's dtype, sum(g * fp32(y)))."""
    rows, h = y.shape
    gy, gw = torch.empty_like(y), torch.empty_like(w)
    _weighted_rows_bwd[(rows,)](g, y, w, gy, gw, h, TO_BF16=y.dtype == torch.bfloat16,
                                BLOCK=triton.next_power_of_2(h), num_warps=8)
    return gy, gw


if triton is not None:
    @triton.jit
    def _add_norm_bwd(x_ptr, r_ptr, w1_ptr, rs_ptr, gn_ptr, gr_ptr, gx_ptr, h, HAS_GN: tl.constexpr,
                      HAS_GR: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < h
        at = row * h + c
        g = tl.zeros([BLOCK], dtype=tl.float32)
        if HAS_GN:
            total = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32) + \
                tl.load(r_ptr + at, mask=ok, other=0.0).to(tl.float32)
            rs = tl.load(rs_ptr + row)
            gn = tl.load(gn_ptr + at, mask=ok, other=0.0).to(tl.float32) * tl.load(w1_ptr + c, mask=ok, other=0.0)
            # d/dtotal of total * rs(total) given its gradient gn: gn * rs - total * rs^3 * mean(gn * total)
            g = gn * rs - total * (rs * rs * rs * (tl.sum(gn * total, 0) / h))
        if HAS_GR:
            g += tl.load(gr_ptr + at, mask=ok, other=0.0).to(tl.float32)
        tl.store(gx_ptr + at, g.to(gx_ptr.dtype.element_ty), mask=ok)

    @triton.jit
    def _weighted_rows_bwd(g_ptr, y_ptr, w_ptr, gy_ptr, gw_ptr, h, TO_BF16: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        c = tl.arange(0, BLOCK)
        ok = c < h
        g = tl.load(g_ptr + row * h + c, mask=ok, other=0.0)
        y = tl.load(y_ptr + row * h + c, mask=ok, other=0.0).to(tl.float32)
        gy = g * tl.load(w_ptr + row)
        if TO_BF16:  # torch's (g * w).to(bf16), bit for bit
            gy = round_bf16(gy)
        tl.store(gy_ptr + row * h + c, gy.to(gy_ptr.dtype.element_ty), mask=ok)
        tl.store(gw_ptr + row, tl.sum(g * y, 0))

    @triton.jit
    def _norm_rope_bwd(x_ptr, w1_ptr, rs_ptr, cs_ptr, g_ptr, gx_ptr, heads, d, half, rot, cs_stride,
                       TO_BF16: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        hh = tl.arange(0, BLOCK_H)[:, None]
        dd = tl.arange(0, BLOCK_D)[None, :]
        ok = (hh < heads) & (dd < d)
        at = row * heads * d + hh * d + dd
        # the inverse rotation: first half x1 cos + x2 sin, second half x2 cos - x1 sin, channels >= rot unchanged
        partner = tl.where(dd < half, dd + half, dd - half)
        rotated = dd < rot
        f = tl.where(dd < half, dd, dd - half)
        cos = tl.load(cs_ptr + row * cs_stride + f, mask=rotated, other=1.0).to(tl.float32)
        sin = tl.load(cs_ptr + row * cs_stride + half + f, mask=rotated, other=0.0).to(tl.float32)
        g = tl.load(g_ptr + at, mask=ok, other=0.0).to(tl.float32)
        gp = tl.load(g_ptr + row * heads * d + hh * d + partner, mask=ok & rotated, other=0.0).to(tl.float32)
        gn = tl.where(dd < half, g * cos + gp * sin, g * cos - gp * sin)
        if TO_BF16:  # the forward stores the norm's output in bf16 before rotating it
            gn = round_bf16(gn)
        gn = gn * tl.load(w1_ptr + dd, mask=dd < d, other=0.0)
        xf = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
        rs = tl.load(rs_ptr + row * heads + hh, mask=hh < heads, other=0.0)
        gx = gn * rs - xf * (rs * rs * rs * (tl.sum(gn * xf, 1)[:, None] / d))
        tl.store(gx_ptr + at, gx.to(gx_ptr.dtype.element_ty), mask=ok)
