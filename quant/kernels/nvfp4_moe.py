"""NVFP4 routed experts in the hopper serving form: ``nvfp4_moe_linear`` (differentiable in x, frozen weights) and
the routing helpers that sort the rows by expert.

Serving form (``quant.forms.nvfp4_linear(..., "hopper")``, what Humming/Marlin run on H200), per
expert e and its rows of the expert-sorted input x:

    y = bf16(fp32acc(x_bf16 @ (e2m1 * s)^T) * gs[e])          forward
    dx = bf16(fp32acc(dy_bf16 @ (e2m1 * s)) * gs[e])          input gradient (the base is frozen)

Layout: ``x`` [M, K] bf16 with the rows of expert e at ``offsets[e]:offsets[e+1]`` (any split,
empty experts included), ``packed`` [E, N, K/2] uint8 (low nibble = even element), ``scale``
[E, N, K/16] float8_e4m3fn (or its uint8 bytes), ``global_scale`` [E] fp32 (decode scale),
``offsets`` [E+1] int32 on the device. ``sort_by_expert`` builds the order and the offsets from
top-k routing ids.

Paths, picked per call and direction: the fused Triton grouped GEMM of ``nvfp4_moe_gemm`` (weights decoded in
registers, fastest at few rows per expert; on sm_90 the input gradient's larger calls run the warp-specialized Gluon
kernel of ``nvfp4_moe_gluon``); from ``DEQUANT_MIN_ROWS`` rows per expert on, the bf16 decode + cuBLAS
of ``nvfp4_dequant``; on CPU, or without Triton, ``nvfp4_moe_linear_reference`` (a loop over experts through
``quant.forms``). Their measurements are in those modules.
"""

import torch

from quant import forms
from quant._common import check_dtype
from quant.kernels._triton import triton_available, triton_version
from quant.kernels.nvfp4_dequant import dequant_dgrad, dequant_fwd
from quant.kernels.nvfp4_moe_gemm import gluon_dgrad_device, launch_dgrad, launch_fwd

__all__ = [
    "expert_offsets",
    "nvfp4_moe_forward",
    "nvfp4_moe_input_grad",
    "nvfp4_moe_linear",
    "nvfp4_moe_linear_reference",
    "sort_by_expert",
]


# ---------------------------------------------------------------------------------------------
# Routing helpers


def expert_offsets(counts: torch.Tensor) -> torch.Tensor:
    """Rows per expert [E] -> int32 offsets [E+1] (offsets[0] = 0, offsets[E] = total)."""
    out = torch.zeros(counts.numel() + 1, dtype=torch.int32, device=counts.device)
    out[1:] = torch.cumsum(counts.reshape(-1), 0).to(torch.int32)
    return out


def sort_by_expert(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing ids [T, k] -> (order, offsets).

    ``order`` [T*k] int64 indexes the flattened (token, slot) pairs sorted by expert (stable, so
    rows of one expert stay in token order): the expert input is ``x[order // k]``; ``offsets``
    [E+1] int32 delimits each expert's rows.
    """
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, expert_offsets(counts)


# ---------------------------------------------------------------------------------------------
# Reference (CPU, or no Triton): loop over experts through quant.forms


def _check(x, packed, scale, global_scale, offsets):
    if packed.ndim != 3:
        raise ValueError(f"packed has shape {tuple(packed.shape)}; expected [E, N, K/2]")
    check_dtype(packed, "packed", torch.uint8)
    check_dtype(scale, "scale", torch.float8_e4m3fn, torch.uint8)
    e, n, kh = packed.shape
    k = kh * 2
    if k % 16 != 0 or tuple(scale.shape) != (e, n, k // 16):
        raise ValueError(
            f"packed {tuple(packed.shape)} and scale {tuple(scale.shape)}: expected [E, N, K/2] and "
            f"[E, N, K/16] with K a multiple of 16"
        )
    if x.ndim != 2 or x.shape[1] != k:
        raise ValueError(f"x has shape {tuple(x.shape)}; expected [M, {k}]")
    if global_scale.numel() != e:
        raise ValueError(f"global_scale has {global_scale.numel()} elements; expected one per expert ({e})")
    if offsets.numel() != e + 1:
        raise ValueError(f"offsets has {offsets.numel()} elements; expected E+1 = {e + 1}")


def nvfp4_moe_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    offsets: torch.Tensor,
) -> torch.Tensor:
    """``forms.nvfp4_linear(x[rows_e], packed[e], scale[e], gs[e], "hopper")`` for each expert.

    Differentiable in x (through ``quant.forms``). Reads the offsets on the host.
    """
    _check(x, packed, scale, global_scale, offsets)
    bounds = offsets.tolist()
    n = packed.shape[1]
    if x.shape[0] != bounds[-1]:
        raise ValueError(f"x has {x.shape[0]} rows; offsets end at {bounds[-1]}")
    gs = global_scale.reshape(-1).to(torch.float32)
    parts = []
    for e in range(packed.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            parts.append(forms.nvfp4_linear(x[lo:hi], packed[e], scale[e], gs[e], "hopper"))
    if not parts:
        return x.new_zeros(x.shape[0], n)
    return torch.cat(parts, 0)


# ---------------------------------------------------------------------------------------------
# CUDA: the fused kernels or the decode + cuBLAS path, per direction

# Rows per expert (average) from which a direction decodes the weights to bf16 once per call and runs cuBLAS
# (quant.kernels.nvfp4_dequant) instead of the fused kernels. Measured on the H200, all 128 M3 experts, gate_up +
# down (results/gpu/run11/bench_expert.json): forward kernel 16.5 ms vs decode 17.9 at 512 rows (16K tokens), 29.4
# vs 28.6 at 1024; input gradient kernel 13.2 vs decode 13.5 at 256 rows, 23.7 vs 17.9 at 512, 45.1 vs 28.4 at 1024.
# "dgrad_gluon": the input gradient where the Gluon kernel is the kernel (sm_90, nvfp4_moe_gemm.GLUON_DGRAD_MIN_ROWS):
# Gluon 17.4 vs decode 18.0 ms at 512 rows, 30.7 vs 29.5 at 1024 (results/gpu/run40/bench_expert.json).
DEQUANT_MIN_ROWS = {"fwd": 768, "dgrad": 384, "dgrad_gluon": 768}
# Under Triton 3.8+ (torch 2.14) the fused forward's kernels are slower (nvfp4_moe_gemm.gluon_fwd_default), and the
# decode path's forward wins from fewer rows: on an H100 at 512 rows (16K tokens) 17.8 ms against 22.1 for the
# Triton kernel and 20.2 for the Gluon one; at 128 rows 13.2 against 9.7 and 7.7 (results/gpu/run129, run131)
FWD_DEQUANT_MIN_ROWS_TRITON_3_8 = 512


def _pick(impl, m, num_experts, direction, gluon=False):
    if impl in ("kernel", "dequant"):
        return impl
    key = "dgrad_gluon" if gluon and direction == "dgrad" else direction
    rows = DEQUANT_MIN_ROWS[key]
    if key == "fwd" and triton_version() >= (3, 8):
        rows = min(rows, FWD_DEQUANT_MIN_ROWS_TRITON_3_8)
    return "dequant" if m >= rows * num_experts else "kernel"


def _host(gs, offsets):
    """The decode scales and offsets on the host, in one sync (offsets < 2^53: exact as doubles)."""
    vals = torch.cat([gs.double(), offsets.double()]).tolist()
    e = gs.numel()
    return vals[:e], [int(v) for v in vals[e:]]


def nvfp4_moe_forward(x, packed, scale, gs, offsets, *, config=None, decoder=None, impl=None, host=None,
                      keep_decoded=False):
    """``nvfp4_moe_linear``'s forward on CUDA operands as it prepares them (bf16 x, fp32 gs [E], int32 offsets),
    outside autograd: (y, decoded, host), what ``nvfp4_moe_input_grad`` takes back: the bf16 weights the decode path
    kept (``keep_decoded``; else None) and the (decode scales, offsets) host lists it read (or the given ``host``).
    For callers that fuse it into their own autograd node (rl.model.lora's experts with LoRA)."""
    decoded = None
    if _pick(impl, x.shape[0], packed.shape[0], "fwd") == "dequant":
        host = host or _host(gs, offsets)
        if keep_decoded and _pick(impl, x.shape[0], packed.shape[0], "dgrad",
                                  gluon_dgrad_device(x, decoder)) == "dequant":
            decoded = torch.empty(*packed.shape[:-1], packed.shape[-1] * 2, dtype=torch.bfloat16,
                                  device=packed.device)
        return dequant_fwd(x, packed, scale, *host, into=decoded), decoded, host
    return launch_fwd(x, packed, scale, gs, offsets, config=config, decoder=decoder), None, host


def nvfp4_moe_input_grad(grad, packed, scale, gs, offsets, *, decoded=None, host=None, decoder=None, impl=None,
                         accumulate=None):
    """The input gradient dx [M, K] = bf16(fp32acc(grad_e @ (e2m1 * s)_e) * gs[e]) of ``nvfp4_moe_forward``'s call
    (its ``decoded`` and ``host``). ``accumulate``: a bf16 [M, K] tensor dx is added to in place and returned, on
    the decode path inside each expert's GEMM (cuBLAS beta = 1: one rounding of the fp32 sum, no [M, K] temporary),
    on the fused kernels' path as one add."""
    g = grad.to(torch.bfloat16)
    if decoded is not None or _pick(impl, g.shape[0], packed.shape[0], "dgrad",
                                    gluon_dgrad_device(g, decoder)) == "dequant":
        return dequant_dgrad(g, packed, scale, *(host or _host(gs, offsets)), decoded=decoded, accumulate=accumulate)
    gx = launch_dgrad(g, packed, scale, gs, offsets, decoder=decoder)
    return gx if accumulate is None else accumulate.add_(gx)


class _NVFP4MoELinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, packed, scale, gs, offsets, config, decoder, impl, host, keep_decoded):  # noqa: D102
        y, decoded, ctx.host = nvfp4_moe_forward(x, packed, scale, gs, offsets, config=config, decoder=decoder,
                                                 impl=impl, host=host, keep_decoded=keep_decoded)
        ctx.decoder, ctx.impl = decoder, impl
        ctx.save_for_backward(packed, scale, gs, offsets, decoded)
        return y

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        packed, scale, gs, offsets, decoded = ctx.saved_tensors
        gx = None
        if ctx.needs_input_grad[0]:
            gx = nvfp4_moe_input_grad(grad, packed, scale, gs, offsets, decoded=decoded, host=ctx.host,
                                      decoder=ctx.decoder, impl=ctx.impl)
        return gx, None, None, None, None, None, None, None, None, None


def prepare(x, packed, scale, global_scale, offsets, decoder=None, impl=None):
    """``nvfp4_moe_linear``'s checks of its arguments and, where its CUDA paths run (else None), the operands as they
    take them: (bf16 x, fp32 decode scales [E], int32 offsets on x's device)."""
    _check(x, packed, scale, global_scale, offsets)
    if decoder is not None and decoder not in ("asm", "triton"):  # DECODERS' "pairs" reads a different layout
        raise ValueError(f"unknown decoder {decoder!r}; expected 'asm' or 'triton'")
    if impl not in (None, "kernel", "dequant"):
        raise ValueError(f"unknown impl {impl!r}; expected 'kernel', 'dequant' or None")
    if not (x.is_cuda and triton_available()):
        return None
    gs = global_scale.reshape(-1).to(device=x.device, dtype=torch.float32).contiguous()
    return x.to(torch.bfloat16), gs, offsets.to(device=x.device, dtype=torch.int32).contiguous()


def nvfp4_moe_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    offsets: torch.Tensor,
    *,
    config: dict | None = None,
    decoder: str | None = None,
    impl: str | None = None,
    host: tuple[list[float], list[int]] | None = None,
    keep_decoded: bool = False,
) -> torch.Tensor:
    """Expert-grouped NVFP4 linear in the hopper serving form: x [M, K] -> [M, N] bf16.

    ``x`` holds the routed rows sorted by expert, expert e's rows at ``offsets[e]:offsets[e+1]``;
    ``packed`` [E, N, K/2] uint8, ``scale`` [E, N, K/16] e4m3, ``global_scale`` [E] fp32 decode
    scales (w13: the gate's, ``quant.forms.fused_w13_global_scale``), ``offsets`` [E+1] int32.
    Differentiable in x (frozen weights). On CUDA with Triton: the fused Triton kernels (bf16 x) or,
    from ``DEQUANT_MIN_ROWS`` rows per expert on, a bf16 decode + cuBLAS per direction (``impl``
    "kernel" / "dequant" forces one; the decode path reads the offsets on the host);
    elsewhere: ``nvfp4_moe_linear_reference``. ``config`` overrides tile sizes, ``decoder`` is
    "asm" (default) or "triton". ``host``: (decode scales, offsets) as host lists, equal to the tensors, when the
    caller has them: the decode path then reads no device values (no sync). ``keep_decoded``: where the forward
    takes the decode path, it keeps the bf16 weights for the input gradient instead of decoding them again; for
    calls recomputed under activation checkpointing, where the weights then live from the recompute to this call's
    backward (kept from a plain forward they would stay until backward: 14.5 GB per M3 layer).
    """
    cuda = prepare(x, packed, scale, global_scale, offsets, decoder, impl)
    if cuda is None:
        return nvfp4_moe_linear_reference(x, packed, scale, global_scale, offsets)
    x, gs, offsets = cuda
    return _NVFP4MoELinear.apply(x, packed, scale, gs, offsets, config, decoder, impl, host, keep_decoded)
