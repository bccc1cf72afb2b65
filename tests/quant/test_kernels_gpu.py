"""Triton kernels (quant.kernels) vs the quant.forms reference forms, on a CUDA GPU.

Self-contained (no vLLM, no quant_oracles). Run through the device tool:
    python -m pytest tests/quant/test_kernels_gpu.py -m gpu -q -p no:cacheprovider

The kernels feed bit-identical operands to the GEMM (e2m1 * s and e4m3 * 2^e are exact in bf16)
and round once from fp32, like the reference; only the fp32 accumulation order differs (tiling,
tensor-core order vs cuBLAS), so outputs cannot be bit-exact in general. The asserted bound, per
output element, for a reduction of length K:

    |y - y_ref| <= ulp_bf16(max(|y|, |y_ref|)) + 2 * K * 2^-24 * (|x| @ |W|^T) * gs

(each fp32 sum is within K * 2^-24 * sum|x_k w_k| of the exact one; each final bf16 round moves
at most half an ulp). Where the sum does not cancel this is at most 1 bf16 ulp of the output.
Also asserted: ||y - y_ref|| / ||y_ref|| <= 2^-8 and >= 90% of outputs bit-identical (typically
> 99%), every output written (NaN-poisoned output buffers), no NaN.
"""

import pytest
import torch

from quant import forms, mxfp8
from quant.kernels import nvfp4_moe as moe
from quant.kernels import nvfp4_moe_gemm as gemm
from quant.kernels.e2m1_asm import to_pair_order
from quant.kernels.mxfp8_linear import _fused_dgrad, _fused_fwd, mxfp8_dequantize, mxfp8_linear

pytestmark = pytest.mark.gpu



@pytest.fixture(autouse=True, scope="module")
def _cuda_and_triton():
    """Deselected on CPU CI (marker gpu); run with -m gpu on a machine without CUDA/Triton, it fails loudly."""
    import importlib.util

    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        pytest.fail("marker gpu: needs a CUDA GPU with Triton")

DEV = "cuda"
BF16 = torch.bfloat16
U = 2.0**-24


# ---------------------------------------------------------------------------------------------
# helpers


def _bf16_ulp(a: torch.Tensor) -> torch.Tensor:
    """ulp of bf16 at |a| (fp32 tensor): 2^(floor(log2|a|) - 7), floored at the subnormal step."""
    e = torch.floor(torch.log2(a.clamp(min=2.0**-126)))
    return torch.exp2(e - 7).clamp(min=2.0**-133)


def _assert_bound(y, ref, absref, k, what=""):
    """The bound of the module docstring; absref = (|x| @ |W|^T) * gs (fp32 or bf16)."""
    assert y.shape == ref.shape, (y.shape, ref.shape)
    yf, rf = y.float(), ref.float()
    assert not torch.isnan(yf).any(), f"{what}: NaN in output"
    assert not torch.isnan(rf).any(), f"{what}: NaN in reference"
    d = (yf - rf).abs()
    bound = _bf16_ulp(torch.maximum(yf.abs(), rf.abs())) + 2 * k * U * absref.float() * 1.01
    bad = d > bound
    assert not bad.any(), (
        f"{what}: {int(bad.sum())} of {d.numel()} outputs off the bound; worst |d|={float(d[bad].max()):.3e} "
        f"bound there {float(bound[bad][d[bad].argmax()]):.3e}"
    )
    rel = float(torch.linalg.vector_norm(yf - rf) / torch.linalg.vector_norm(rf).clamp(min=1e-30))
    assert rel <= 2.0**-8, f"{what}: relative error {rel:.3e}"
    same = float((y.view(torch.int16) == ref.view(torch.int16)).float().mean()) if y.numel() else 1.0
    assert same >= 0.90, f"{what}: only {same:.4f} of outputs bit-identical"
    return same, rel


def _nvfp4_stack(e, n, k, gen, scale_lo=0x28, scale_hi=0x70, subnormal_frac=0.02):
    """Random NVFP4 expert stack on the GPU: all 256 code pairs, E4M3 scales in [lo, hi] plus a
    few subnormal (0x01-0x07) and zero scales, per-expert decode global scales."""
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device=DEV, generator=gen)
    sb = torch.randint(scale_lo, scale_hi + 1, (e, n, k // 16), dtype=torch.uint8, device=DEV, generator=gen)
    r = torch.rand(sb.shape, device=DEV, generator=gen)
    sb = torch.where(r < subnormal_frac, torch.randint_like(sb, 0, 8), sb)
    gs = (torch.rand(e, device=DEV, generator=gen) * 2e-3 + 1e-4).float()
    return packed, sb.view(torch.float8_e4m3fn), gs


def _abs_stack(packed, scale):
    """|W|: codes with the sign bits cleared (e2m1 magnitude), same scales."""
    return packed & 0x77, scale


def _routing(tokens, e, topk, gen, skew=None):
    """Top-k routing ids [T, k] (distinct experts per token); skew: exponent of a Zipf-like
    preference (None = uniform)."""
    scores = torch.rand(tokens, e, device=DEV, generator=gen)
    if skew is not None:
        w = torch.arange(1, e + 1, device=DEV, dtype=torch.float32) ** (-skew)
        scores = scores * w
    return scores.topk(topk, dim=1).indices


def _offsets_from_counts(counts):
    return moe.expert_offsets(torch.tensor(counts, device=DEV))


def _ref_fwd(x, packed, scale, gs, offsets):
    return moe.nvfp4_moe_linear_reference(x, packed, scale, gs, offsets)


def _ref_dgrad(dy, packed, scale, gs, offsets):
    """serving form of the input gradient: bf16(fp32acc(dy @ (e2m1*s)) * gs) per expert."""
    bounds = offsets.tolist()
    out = torch.empty(dy.shape[0], packed.shape[2] * 2, dtype=BF16, device=dy.device)
    for e in range(packed.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi > lo:
            w = forms.nvfp4_weight(packed[e], scale[e], BF16)
            out[lo:hi] = (forms._mm_fp32(dy[lo:hi], w.t()) * gs[e]).to(BF16)
    return out


def _check_moe(x, packed, scale, gs, offsets, decoder, what):
    k = x.shape[1]
    n = packed.shape[1]
    ref = _ref_fwd(x, packed, scale, gs, offsets)
    absref = _ref_fwd(x.abs(), *_abs_stack(packed, scale), gs, offsets)
    w = to_pair_order(packed) if decoder == "pairs" else packed  # the references read the serving order
    out = torch.full((x.shape[0], n), float("nan"), dtype=BF16, device=DEV)
    y = gemm.launch_fwd(x, w, scale, gs, offsets, out=out, decoder=decoder)
    torch.cuda.synchronize()
    fwd = _assert_bound(y, ref, absref, k, f"{what} fwd")
    dy = torch.randn(x.shape[0], n, device=DEV, dtype=BF16)
    ref_dx = _ref_dgrad(dy, packed, scale, gs, offsets)
    abs_dx = _ref_dgrad(dy.abs(), *_abs_stack(packed, scale), gs, offsets)
    out = torch.full(x.shape, float("nan"), dtype=BF16, device=DEV)
    dx = gemm.launch_dgrad(dy, w, scale, gs, offsets, out=out, decoder=decoder)
    torch.cuda.synchronize()
    bwd = _assert_bound(dx, ref_dx, abs_dx, n, f"{what} dgrad")
    return fwd, bwd


# ---------------------------------------------------------------------------------------------
# NVFP4 grouped GEMM


@pytest.mark.parametrize("decoder", ["asm", "triton", "pairs"])
@pytest.mark.parametrize(
    "e,n,k,counts",
    [
        (8, 256, 512, [8] * 8),  # <= 16 rows per expert: BM=16, swapped dgrad
        (8, 256, 512, [25, 0, 31, 17, 1, 40, 33, 53]),  # BM=32 bucket, one empty expert
        (8, 384, 384, [75, 64, 90, 0, 128, 33, 65, 145]),  # BM=64 bucket
        (4, 256, 1024, [300, 129, 0, 371]),  # BM=128 bucket
        (6, 200, 272, [5, 0, 0, 19, 1, 40]),  # N not a multiple of the tile, K not of BK
    ],
)
def test_nvfp4_moe_small(e, n, k, counts, decoder):
    gen = torch.Generator(device=DEV).manual_seed(1234 + e * n + k + sum(counts))
    packed, scale, gs = _nvfp4_stack(e, n, k, gen)
    offsets = _offsets_from_counts(counts)
    x = torch.randn(sum(counts), k, device=DEV, dtype=BF16, generator=gen)
    _check_moe(x, packed, scale, gs, offsets, decoder, f"E{e} N{n} K{k} {decoder}")


CONFIG_VARIANTS = {  # tile configs beside the defaults (scripts/bench_expert_gemm.py --variants times them)
    "fwd_BM256": ("fwd", gemm.fwd_config(1 << 20, 1)),  # the default at many tokens (run 7; 2 stages on Triton 3.8)
    "fwd_BM32": ("fwd", dict(BM=32, BN=128, BK=128, num_warps=4, num_stages=4)),  # ~16 rows per expert
    "dgrad_BM256_BN64": ("dgrad", dict(BM=256, BK=128, BN=64, num_warps=8, num_stages=3, SWAP=False)),
    "dgrad_BM256_BN128_st2": ("dgrad", dict(BM=256, BK=128, BN=128, num_warps=8, num_stages=2, SWAP=False)),
    "dgrad_BM128_BN64": ("dgrad", dict(BM=128, BK=128, BN=64, num_warps=8, num_stages=3, SWAP=False)),
    # the weights on the MMA's M side (A from registers: the MMAs stay async, pendings 3-7 in the compiled TTGIR,
    # where the SWAP=False tiles wait on each one because the decoded B tile is single-buffered in shared memory)
    "dgrad_BM128_BN64_swap": ("dgrad", dict(BM=128, BK=128, BN=64, num_warps=8, num_stages=3, SWAP=True)),
    "dgrad_BM128_BN128_swap": ("dgrad", dict(BM=128, BK=128, BN=128, num_warps=8, num_stages=3, SWAP=True)),
    "dgrad_BM64_BN64_swap": ("dgrad", dict(BM=64, BK=128, BN=64, num_warps=4, num_stages=4, SWAP=True)),
    "dgrad_BM256_BN64_swap": ("dgrad", dict(BM=256, BK=128, BN=64, num_warps=8, num_stages=3, SWAP=True)),
    # the warp-specialized Gluon kernel (quant/kernels/nvfp4_moe_gluon.py): decode warps beside the MMA warps
    "dgrad_gluon_BM64": ("dgrad", dict(GLUON=True, BM=64)),
    "dgrad_gluon_BM128": ("dgrad", dict(GLUON=True, BM=128)),
    "dgrad_gluon_BM128_DW8": ("dgrad", dict(GLUON=True, BM=128, DW=8, DREGS=96)),
    "dgrad_gluon_BM256": ("dgrad", dict(GLUON=True, BM=256)),
    "dgrad_gluon_BM256_DW8": ("dgrad", dict(GLUON=True, BM=256, DW=8, DREGS=64)),
    "fwd_gluon_BM64": ("fwd", dict(GLUON=True, BM=64)),
    "fwd_gluon_BM128": ("fwd", dict(GLUON=True, BM=128)),
    "fwd_gluon_BM128_DW8": ("fwd", dict(GLUON=True, BM=128, DW=8, DREGS=96)),
    "fwd_gluon_BM256": ("fwd", dict(GLUON=True, BM=256)),
    "fwd_gluon_BM256_DW8": ("fwd", dict(GLUON=True, BM=256, DW=8, DREGS=64)),
    # the weights in e2m1_asm's pair order (to_pair_order): fewer decode instructions, one multiply per pair
    "dgrad_gluon_BM256_DW8_PAIRS": ("dgrad", dict(GLUON=True, BM=256, DW=8, DREGS=64, PAIRS=True)),
    "dgrad_gluon_BM128_PAIRS": ("dgrad", dict(GLUON=True, BM=128, PAIRS=True)),
    "fwd_gluon_BM256_DW8_PAIRS": ("fwd", dict(GLUON=True, BM=256, DW=8, DREGS=64, PAIRS=True)),
}


@pytest.mark.parametrize("name", list(CONFIG_VARIANTS))
def test_nvfp4_moe_config_variants(name):
    direction, cfg = CONFIG_VARIANTS[name]
    gen = torch.Generator(device=DEV).manual_seed(21)
    e, n, k = 4, 256, 512
    packed, scale, gs = _nvfp4_stack(e, n, k, gen)
    offsets = _offsets_from_counts([300, 17, 0, 600])
    fwd = direction == "fwd"
    reference, launch = (_ref_fwd, gemm.launch_fwd) if fwd else (_ref_dgrad, gemm.launch_dgrad)
    inp = torch.randn(917, k if fwd else n, device=DEV, dtype=BF16, generator=gen)
    ref = reference(inp, packed, scale, gs, offsets)
    absref = reference(inp.abs(), *_abs_stack(packed, scale), gs, offsets)
    out = torch.full((inp.shape[0], n if fwd else k), float("nan"), dtype=BF16, device=DEV)
    got = launch(inp, to_pair_order(packed) if cfg.get("PAIRS") else packed, scale, gs, offsets, out=out, config=cfg)
    _assert_bound(got, ref, absref, k if fwd else n, f"config {name}")


@pytest.mark.parametrize("e,n,k,counts", [(8, 384, 384, [75, 64, 90, 0, 128, 33, 65, 145]),
                                           (6, 200, 272, [5, 0, 0, 19, 1, 40]),  # N, K not multiples of the tile
                                           (3, 256, 512, [0, 700, 1])])  # several tiles of one expert, first empty
def test_nvfp4_moe_gluon_edges(e, n, k, counts):
    """The Gluon kernels both ways, with tiles cut by N, K and the experts' row counts."""
    gen = torch.Generator(device=DEV).manual_seed(99 + n + k)
    packed, scale, gs = _nvfp4_stack(e, n, k, gen)
    offsets = _offsets_from_counts(counts)
    x = torch.randn(sum(counts), k, device=DEV, dtype=BF16, generator=gen)
    dy = torch.randn(sum(counts), n, device=DEV, dtype=BF16, generator=gen)
    for inp, reference, launch, red in ((x, _ref_fwd, gemm.launch_fwd, k), (dy, _ref_dgrad, gemm.launch_dgrad, n)):
        ref = reference(inp, packed, scale, gs, offsets)
        absref = reference(inp.abs(), *_abs_stack(packed, scale), gs, offsets)
        for bm, pairs in ((64, False), (128, False), (256, False), (128, True), (256, True)):
            out = torch.full(ref.shape, float("nan"), dtype=BF16, device=DEV)
            got = launch(inp, to_pair_order(packed) if pairs else packed, scale, gs, offsets, out=out,
                         config=dict(GLUON=True, BM=bm, PAIRS=pairs))
            _assert_bound(got, ref, absref, red, f"gluon {launch.__name__} BM={bm} PAIRS={pairs} E{e} N{n} K{k}")


def test_nvfp4_moe_skewed_and_empty():
    """Everything on few experts (one takes > half the rows), most experts empty, first and last
    expert empty, and an all-empty call."""
    gen = torch.Generator(device=DEV).manual_seed(7)
    e, n, k = 32, 256, 512
    packed, scale, gs = _nvfp4_stack(e, n, k, gen)
    counts = [0] * e
    counts[3], counts[4], counts[17], counts[30] = 700, 1, 129, 15
    offsets = _offsets_from_counts(counts)
    x = torch.randn(sum(counts), k, device=DEV, dtype=BF16, generator=gen)
    _check_moe(x, packed, scale, gs, offsets, None, "skewed")
    empty = gemm.launch_fwd(x[:0], packed, scale, gs, _offsets_from_counts([0] * e))
    assert empty.shape == (0, n)


def test_nvfp4_moe_nan_scale_propagates():
    """A NaN block scale (0x7F) makes the rows that touch it NaN, like the reference."""
    gen = torch.Generator(device=DEV).manual_seed(9)
    e, n, k = 2, 128, 256
    packed, scale, gs = _nvfp4_stack(e, n, k, gen)
    sb = scale.view(torch.uint8).clone()
    sb[1, 5, 3] = 0x7F
    offsets = _offsets_from_counts([3, 4])
    x = torch.randn(7, k, device=DEV, dtype=BF16, generator=gen)
    y = gemm.launch_fwd(x, packed, sb.view(torch.float8_e4m3fn), gs, offsets)
    ref = _ref_fwd(x, packed, sb.view(torch.float8_e4m3fn), gs, offsets)
    assert torch.equal(torch.isnan(y), torch.isnan(ref))
    assert torch.isnan(y[3:, 5]).all() and not torch.isnan(y[:3]).any()
    yp = gemm.launch_fwd(x, to_pair_order(packed), sb.view(torch.float8_e4m3fn), gs, offsets,
                         config=dict(GLUON=True, BM=64, PAIRS=True))
    assert torch.equal(torch.isnan(yp), torch.isnan(ref))


def test_sort_by_expert():
    gen = torch.Generator(device=DEV).manual_seed(3)
    ids = _routing(100, 16, 4, gen, skew=1.0)
    order, offsets = moe.sort_by_expert(ids, 16)
    flat = ids.reshape(-1)
    assert offsets[0] == 0 and offsets[-1] == flat.numel()
    sorted_ids = flat[order]
    for ex in range(16):
        assert (sorted_ids[offsets[ex]:offsets[ex + 1]] == ex).all()


def test_nvfp4_moe_autograd():
    """nvfp4_moe_linear forward + backward vs the reference autograd through quant.forms."""
    gen = torch.Generator(device=DEV).manual_seed(11)
    e, n, k = 8, 384, 256
    packed, scale, gs = _nvfp4_stack(e, n, k, gen)
    ids = _routing(40, e, 2, gen)
    order, offsets = moe.sort_by_expert(ids, e)
    x0 = torch.randn(40, k, device=DEV, dtype=BF16, generator=gen)
    xs = x0[order // 2]
    g = torch.randn(xs.shape[0], n, device=DEV, dtype=BF16, generator=gen)
    xa = xs.clone().requires_grad_(True)
    y = moe.nvfp4_moe_linear(xa, packed, scale, gs, offsets)
    y.backward(g)
    xb = xs.clone().requires_grad_(True)
    yr = moe.nvfp4_moe_linear_reference(xb, packed, scale, gs, offsets)
    yr.backward(g)
    absref = _ref_fwd(xs.abs(), *_abs_stack(packed, scale), gs, offsets)
    _assert_bound(y.detach(), yr.detach(), absref, k, "autograd fwd")
    abs_dx = _ref_dgrad(g.abs(), *_abs_stack(packed, scale), gs, offsets)
    _assert_bound(xa.grad, xb.grad, abs_dx, n, "autograd dgrad")


@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("tokens,skew", [(256, None), (512, 1.2)])
def test_nvfp4_moe_m3_shapes(which, tokens, skew):
    """Real M3 expert shapes: 128 experts, hidden 6144, expert intermediate 3072 (gate|up fused
    6144 x 6144, down 6144 x 3072), top-4 routing, uniform and Zipf-skewed."""
    e, hidden, inter = 128, 6144, 3072
    n, k = (2 * inter, hidden) if which == "gate_up" else (hidden, inter)
    gen = torch.Generator(device=DEV).manual_seed(tokens + (0 if skew is None else 1) + n + k)
    packed, scale, gs = _nvfp4_stack(e, n, k, gen)
    ids = _routing(tokens, e, 4, gen, skew=skew)
    order, offsets = moe.sort_by_expert(ids, e)
    x = torch.randn(tokens, k, device=DEV, dtype=BF16, generator=gen)[order // 4].contiguous()
    (same, rel), (same_b, rel_b) = _check_moe(x, packed, scale, gs, offsets, None, f"M3 {which} T{tokens}")
    print(f"M3 {which} T{tokens} skew={skew}: fwd bit-identical {same:.4f} rel {rel:.2e}; "
          f"dgrad bit-identical {same_b:.4f} rel {rel_b:.2e}")


# ---------------------------------------------------------------------------------------------
# MXFP8


def _mxfp8_weight(n, k, gen, lo=112, hi=135):
    q = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=DEV, generator=gen)
    q = torch.where((q & 0x7F) == 0x7F, q ^ 0x01, q)  # no NaN elements
    s = torch.randint(lo, hi + 1, (n, k // 32), dtype=torch.uint8, device=DEV, generator=gen)
    return q.view(torch.float8_e4m3fn), s


def test_mxfp8_dequantize_bit_exact():
    gen = torch.Generator(device=DEV).manual_seed(5)
    q, _ = _mxfp8_weight(256, 1024, gen)
    s = torch.randint(20, 256, (256, 32), dtype=torch.uint8, device=DEV, generator=gen)  # incl. 255 = NaN
    got = mxfp8_dequantize(q, s)
    ref = mxfp8.dequantize(q, s, BF16)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


@pytest.mark.parametrize("impl", ["fused", "dequant"])
@pytest.mark.parametrize(
    "m,n,k,bias",
    [(1, 256, 512, False), (37, 384, 96, True), (200, 512, 1024, False), (700, 640, 2048, True),
     (512, 8192, 6144, False), (2048, 6144, 8192, False)],
)
def test_mxfp8_linear(m, n, k, bias, impl):
    gen = torch.Generator(device=DEV).manual_seed(m + n + k)
    q, s = _mxfp8_weight(n, k, gen)
    b = torch.randn(n, device=DEV, dtype=BF16, generator=gen) if bias else None
    x = torch.randn(m, k, device=DEV, dtype=BF16, generator=gen)
    ref = forms.mxfp8_linear(x, q, s, "hopper", bias=b)
    w = mxfp8.dequantize(q, s, BF16)
    absref = (x.abs().float() @ w.abs().float().t())
    if b is not None:
        absref = absref + b.abs().float()
    xa = x.clone().requires_grad_(True)
    y = mxfp8_linear(xa, q, s, b, impl=impl)
    _assert_bound(y.detach(), ref, absref, k, f"mxfp8 {impl} fwd {m}x{n}x{k}")
    g = torch.randn(m, n, device=DEV, dtype=BF16, generator=gen)
    y.backward(g)
    ref_dx = g @ w
    abs_dx = g.abs().float() @ w.abs().float()
    _assert_bound(xa.grad, ref_dx, abs_dx, n, f"mxfp8 {impl} dgrad {m}x{n}x{k}")


def test_mxfp8_fused_writes_everything():
    gen = torch.Generator(device=DEV).manual_seed(17)
    q, s = _mxfp8_weight(320, 160, gen)
    x = torch.randn(70, 160, device=DEV, dtype=BF16, generator=gen)
    y = _fused_fwd(x, q, s.view(torch.uint8), None)
    dx = _fused_dgrad(torch.randn(70, 320, device=DEV, dtype=BF16, generator=gen), q, s.view(torch.uint8))
    assert not torch.isnan(y).any() and not torch.isnan(dx).any()
    assert y.shape == (70, 320) and dx.shape == (70, 160)


# ---------------------------------------------------------------------------------------------
# NVFP4 at many rows per expert: bf16 decode + cuBLAS (quant.kernels.nvfp4_dequant)


@pytest.mark.parametrize("asm", [True, False])
@pytest.mark.parametrize("shape", [(3, 64, 512), (1, 9, 264)], ids=["even", "partial_row"])
def test_nvfp4_dequantize_bit_exact_cuda(shape, asm):
    """The decode kernel (the bf16x2 asm and the integer-field decoder) on every code byte and every scale byte, in
    programs without masks (even) and with a last row ending mid-program (9 x 33 16-code groups)."""
    from quant.kernels.nvfp4_dequant import launch_decode

    gen = torch.Generator(device=DEV).manual_seed(31)
    e, n, kh = shape
    packed = torch.randint(0, 256, (e, n, kh), dtype=torch.uint8, device=DEV, generator=gen)
    scale = torch.randint(0, 256, (e, n, kh // 8), dtype=torch.uint8, device=DEV, generator=gen)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8, device=DEV)
    scale.view(-1)[:256] = torch.arange(256, dtype=torch.uint8, device=DEV)
    out = torch.full((e, n, 2 * kh), float("nan"), dtype=BF16, device=DEV)
    got = launch_decode(packed, scale, out, asm=asm)
    ref = forms.nvfp4_weight(packed, scale.view(torch.float8_e4m3fn), BF16)
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_nvfp4_moe_dequant_path(chunk, overlap):
    """Forward and input gradient through the decode + cuBLAS path (gs as cuBLAS alpha on the fp32 accumulator):
    the same bound as the kernels (one rounding after gs: a second rounding would fail the bit-identity check)."""
    from quant.kernels.nvfp4_dequant import dequant_dgrad, dequant_fwd

    gen = torch.Generator(device=DEV).manual_seed(41 + chunk)
    e, n, k = 8, 384, 512
    packed, scale, gs = _nvfp4_stack(e, n, k, gen)
    counts = [300, 0, 129, 1, 0, 517, 64, 0]
    offsets = _offsets_from_counts(counts)
    bounds, gsh = offsets.tolist(), gs.tolist()
    x = torch.randn(sum(counts), k, device=DEV, dtype=BF16, generator=gen)
    y = dequant_fwd(x, packed, scale, gsh, bounds, chunk=chunk, overlap=overlap)
    torch.cuda.synchronize()
    _assert_bound(y, _ref_fwd(x, packed, scale, gs, offsets),
                  _ref_fwd(x.abs(), *_abs_stack(packed, scale), gs, offsets), k, f"dequant fwd c{chunk}")
    dy = torch.randn(sum(counts), n, device=DEV, dtype=BF16, generator=gen)
    dx = dequant_dgrad(dy, packed, scale, gsh, bounds, chunk=chunk, overlap=overlap)
    torch.cuda.synchronize()
    _assert_bound(dx, _ref_dgrad(dy, packed, scale, gs, offsets),
                  _ref_dgrad(dy.abs(), *_abs_stack(packed, scale), gs, offsets), n, f"dequant dgrad c{chunk}")
    # the forward's decode kept (`into`, decoded on the side stream with overlap) serves the input gradient: the same
    # results, bit for bit
    kept = torch.full((e, n, k), float("nan"), dtype=BF16, device=DEV)
    assert torch.equal(dequant_fwd(x, packed, scale, gsh, bounds, chunk=chunk, overlap=overlap, into=kept), y)
    assert torch.equal(dequant_dgrad(dy, packed, scale, gsh, bounds, chunk=chunk, overlap=overlap, decoded=kept), dx)
    # accumulate= (cuBLAS beta = 1, the one-node expert LoRA's input gradient): acc + dx rounded once, within the
    # bound of the fp32 sum, and never further from it than dx rounded first and added
    acc = (torch.randn(sum(counts), k, device=DEV, generator=gen) * float(dx.float().abs().mean())).to(BF16)
    got = dequant_dgrad(dy, packed, scale, gsh, bounds, chunk=chunk, overlap=overlap, decoded=kept,
                        accumulate=acc.clone())
    exact = acc.float()
    for i in range(e):
        if bounds[i + 1] > bounds[i]:
            w = forms.nvfp4_weight(packed[i], scale[i], BF16)
            exact[bounds[i]:bounds[i + 1]] += forms._mm_fp32(dy[bounds[i]:bounds[i + 1]], w.t()) * gs[i]
    err_one, err_two = ((t.float() - exact).norm() / exact.norm() for t in (got, dx + acc))
    assert float(err_one) <= 2.0**-8 and float(err_one) <= float(err_two), (float(err_one), float(err_two))


@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_nvfp4_moe_dequant_m3_shapes(which):
    """All 128 M3 experts at 4096 tokens (top-4, skewed) through nvfp4_moe_linear(impl="dequant"), fwd + dgrad."""
    e, hidden, inter = 128, 6144, 3072
    n, k = (2 * inter, hidden) if which == "gate_up" else (hidden, inter)
    gen = torch.Generator(device=DEV).manual_seed(n + k)
    packed, scale, gs = _nvfp4_stack(e, n, k, gen)
    order, offsets = moe.sort_by_expert(_routing(4096, e, 4, gen, skew=1.0), e)
    x = torch.randn(4096, k, device=DEV, dtype=BF16, generator=gen)[order // 4].contiguous().requires_grad_(True)
    y = moe.nvfp4_moe_linear(x, packed, scale, gs, offsets, impl="dequant")
    dy = torch.randn(y.shape, device=DEV, dtype=BF16, generator=gen)
    y.backward(dy)
    xd = x.detach()
    _assert_bound(y.detach(), _ref_fwd(xd, packed, scale, gs, offsets),
                  _ref_fwd(xd.abs(), *_abs_stack(packed, scale), gs, offsets), k, f"M3 {which} dequant fwd")
    _assert_bound(x.grad, _ref_dgrad(dy, packed, scale, gs, offsets),
                  _ref_dgrad(dy.abs(), *_abs_stack(packed, scale), gs, offsets), n, f"M3 {which} dequant dgrad")


# ---------------------------------------------------------------------------------------------
# Grouped expert LoRA (torch._grouped_mm) vs the per-expert loop


def test_grouped_expert_lora_cuda():
    from rl.model.lora import ExpertLoRA, LoRAConfig

    gen = torch.Generator(device=DEV).manual_seed(51)
    e, hidden, inter = 128, 1024, 512
    lora = ExpertLoRA(e, hidden, inter, LoRAConfig(rank=32, alpha=64)).to(DEV)
    with torch.no_grad():
        for p in lora.parameters():
            p.copy_((torch.randn(p.shape, device=DEV, generator=gen) * 0.05).to(BF16).float())
    order, offsets = moe.sort_by_expert(_routing(2048, e, 4, gen, skew=1.3), e)
    counts = (offsets[1:] - offsets[:-1]).tolist()
    assert 0 in counts  # skew leaves some experts empty
    x0 = torch.randn(offsets[-1].item(), hidden, device=DEV, dtype=BF16, generator=gen)
    g = torch.randn(x0.shape[0], 2 * inter, device=DEV, dtype=BF16, generator=gen)
    res = []
    for grouped in (True, False):
        lora.zero_grad(set_to_none=True)
        x = x0.clone().requires_grad_(True)
        if grouped:
            y = lora.gate_up_grouped(x, offsets)
        else:
            b = offsets.tolist()
            y = torch.cat([lora.gate_up(x[b[i]:b[i + 1]], i) for i in range(e)])
        y.backward(g)
        res.append([y.detach(), x.grad, lora.gate_up_A.grad.clone(), lora.gate_up_B.grad.clone()])
    for name, a, b in zip(("y", "dx", "dA", "dB"), *res):
        assert torch.isfinite(a).all(), name
        rel = float((a.float() - b.float()).norm() / b.float().norm())
        assert rel <= 4e-3, f"{name}: rel {rel:.2e}"
    empty = torch.tensor([c == 0 for c in counts], device=DEV)
    assert (res[0][2][empty] == 0).all() and (res[0][3][empty] == 0).all()
