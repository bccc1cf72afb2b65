"""NVFP4 codec vs vLLM's reference functions (notes quant-formats.md section 8, families 1-7, 9)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from quant_oracles import (
    DEVICES,
    assert_bitwise_equal,
    bits,
    e2m1_code_rne,
    mxfp8_utils,
    nvfp4_emulation_utils,
    vllm_nvfp4_dequant,
    vllm_nvfp4_qdq,
    vllm_nvfp4_quant,
)

from quant import nvfp4
from quant._common import e2m1_codes, to_e4m3

F32 = torch.float32


def _gs(v: float, device="cpu") -> torch.Tensor:
    return torch.tensor(v, dtype=F32, device=device)


def _check_quant_vs_vllm(x: torch.Tensor, gs_enc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize must equal vLLM ref_nvfp4_quant: scales bitwise (NaN = NaN) and element values
    bitwise, including the sign of zero."""
    packed, scale = nvfp4.quantize(x, global_scale_enc=gs_enc)
    ref_vals, ref_scale = vllm_nvfp4_quant(x, gs_enc)
    assert_bitwise_equal(scale.float(), ref_scale, nan_equal=True)
    finite = ~torch.isnan(ref_scale).repeat_interleave(16, dim=-1)
    vals = nvfp4.unpack_values(packed).cpu()
    assert torch.equal(bits(vals)[finite], bits(ref_vals)[finite])
    return packed, scale


# ---- family 1: E2M1 grid and packing ---------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_every_byte_unpacks_like_vllm(device):
    packed = torch.arange(256, dtype=torch.uint8, device=device).reshape(16, 16)
    codes = nvfp4.unpack_codes(packed)
    assert torch.equal(codes[:, 0::2].cpu(), (packed & 0x0F).cpu())  # even element = low nibble
    assert torch.equal(codes[:, 1::2].cpu(), (packed >> 4).cpu())
    ref = nvfp4_emulation_utils.break_fp4_bytes(packed.cpu(), F32)
    assert_bitwise_equal(nvfp4.unpack_values(packed), ref)
    table = nvfp4.e2m1_table()
    assert table[8].item() == 0.0 and math.copysign(1.0, table[8].item()) == -1.0  # code 8 = -0
    assert torch.equal(nvfp4.pack_codes(codes), packed)


@given(st.lists(st.integers(0, 15), min_size=2, max_size=64).filter(lambda v: len(v) % 2 == 0))
@settings(max_examples=60, deadline=None)
def test_pack_unpack_round_trip(codes):
    c = torch.tensor(codes, dtype=torch.uint8)
    assert torch.equal(nvfp4.unpack_codes(nvfp4.pack_codes(c)), c)


# ---- family 2: E2M1 rounding with s = gs = 1 --------------------------------------------------

TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)
TIE_CODES = (0, 2, 2, 4, 4, 6, 6)  # ties go to the even code


def _next(v: float, toward: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(toward)))


def _unit_scale_rows() -> list[list[float]]:
    """Rows of 16 whose first element 6.0 pins amax = 6, so s = 1 when gs_enc = 1."""
    rows = [[6.0, *TIES, *(-t for t in TIES), -1e-9]]
    for side in (math.inf, -math.inf):
        row = [6.0] + [_next(t, side) for t in TIES] + [-_next(t, side) for t in TIES] + [0.0]
        rows.append(row)
    rows.append([6.0001, -6.0001, 6.0, -6.0, 0.0, -0.0] + [0.5] * 10)
    return rows


@pytest.mark.parametrize("device", DEVICES)
def test_e2m1_rounding_ties_and_neighbours(device):
    x = torch.tensor(_unit_scale_rows(), dtype=F32, device=device)
    packed, scale = _check_quant_vs_vllm(x, _gs(1.0, device))
    assert torch.all(scale.float().cpu() == 1.0)
    codes = nvfp4.unpack_codes(packed).cpu()
    assert codes[0, 1:8].tolist() == list(TIE_CODES)
    assert codes[0, 8:15].tolist() == [c | 8 for c in TIE_CODES]
    assert codes[0, 15].item() == 8  # -1e-9 -> -0 (vLLM keeps the sign: 0 * sign(x) = -0.0)
    expected = [[e2m1_code_rne(v) for v in row] for row in x.clamp(-6, 6).cpu().tolist()]
    expected[3][5] = 0  # -0.0 input: sign(-0.0) = 0 in torch, so vLLM writes +0
    assert codes.tolist() == expected


@pytest.mark.parametrize("device", DEVICES)
def test_saturation_inf_nan_blocks(device):
    rows = [
        [1e30] + [1.0] * 15,  # huge amax: scale saturates at 448, the rest rounds to 0
        [math.inf, -math.inf] + [3.0] * 14,
        [math.nan] + [1.0] * 15,  # NaN block: scale NaN (0x7F), decodes to NaN everywhere
        [2.0] * 16,  # a normal block next to them is unaffected
    ]
    x = torch.tensor(rows, dtype=F32, device=device)
    packed, scale = _check_quant_vs_vllm(x, _gs(1.0, device))
    sb = scale.view(torch.uint8).cpu()[:, 0]
    assert sb[:2].tolist() == [0x7E, 0x7E] and sb[2].item() == 0x7F
    codes = nvfp4.unpack_codes(packed).cpu()
    assert codes[1, :2].tolist() == [7, 15]
    assert torch.all(codes[2] == 0)
    out = nvfp4.dequantize(packed, scale, 1.0, F32).cpu()
    assert torch.isnan(out[2]).all() and not torch.isnan(out[[0, 1, 3]]).any()


# ---- family 3 and 14: E4M3 block-scale rounding, the 448/464 boundary -------------------------

# (gs_enc, expected scale byte): with amax = 6, s = e4m3(gs_enc * (6 * fp32(1/6))) = e4m3(gs_enc).
SCALE_CASES = [
    (1.0625, 0x38),  # tie 1.0625 -> 1.0 (even mantissa)
    (1.1875, 0x3A),  # tie 1.1875 -> 1.25
    (448.0, 0x7E),
    (456.0, 0x7E),
    (464.0, 0x7E),
    (464.1, 0x7E),  # NaN on torch 2.11 without the explicit clamp
    (1e9, 0x7E),
    (1.5 * 2**-9, 0x02),  # subnormal tie -> 2^-8 (even)
    (0.5 * 2**-9, 0x00),  # tie between 0 and 2^-9 -> 0
    (_next(0.5 * 2**-9, 1.0), 0x01),
    (_next(2**-10, 0.0), 0x00),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("gs_enc", "byte"), SCALE_CASES)
def test_block_scale_rounding(device, gs_enc, byte):
    x = torch.tensor([[6.0, -3.0, 1.5, 0.75] * 4], dtype=F32, device=device)
    _, scale = _check_quant_vs_vllm(x, _gs(gs_enc, device))
    assert scale.view(torch.uint8).item() == byte


@pytest.mark.parametrize("device", DEVICES)
def test_e4m3_cast_is_clamped_on_every_torch(device):
    v = torch.tensor([447.0, 460.0, 464.0, 464.1, 1e9, math.inf, -464.1, -math.inf], device=device)
    assert to_e4m3(v).view(torch.uint8).tolist() == [0x7E] * 6 + [0xFE] * 2
    assert to_e4m3(torch.tensor([math.nan], device=device)).view(torch.uint8).item() == 0x7F


# ---- family 4: zero and tiny blocks -----------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_zero_and_tiny_blocks(device):
    gs = _gs(1.0, device)
    rows = torch.zeros(4, 16, device=device)
    rows[1] = torch.linspace(-1, 1, 16) * 6 * 2**-11  # a * gs / 6 = 2^-11 < 2^-10: scale 0
    rows[2, 3] = -0.0
    rows[3] = torch.linspace(-1, 1, 16) * 6 * 2**-9  # smallest non-zero scale: kept
    packed, scale = _check_quant_vs_vllm(rows, gs)
    assert scale.view(torch.uint8).cpu()[:, 0].tolist() == [0, 0, 0, 1]
    codes = nvfp4.unpack_codes(packed).cpu()
    assert torch.all(codes[:3] & 7 == 0)  # magnitude 0 ...
    assert torch.equal(codes[1] >> 3, (rows[1] < 0).cpu().to(torch.uint8))  # ... sign as vLLM's -0.0
    assert torch.all(nvfp4.dequantize(packed, scale, 1.0, F32)[:3] == 0)


# ---- random tensors ----------------------------------------------------------------------------


def _random_inputs(device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    normal = torch.randn(64, 256, generator=g)
    heavy = torch.randn(64, 256, generator=g) / torch.rand(64, 256, generator=g).clamp(min=1e-3).sqrt()
    heavy[::7] *= 1e-6  # tiny rows: zero / subnormal block scales
    heavy[3] = 0.0
    wide = torch.randn(8, 4, 128, generator=g) * torch.exp2(torch.randint(-20, 20, (8, 4, 1), generator=g).float())
    return [t.to(device) for t in (normal, heavy.to(torch.bfloat16), wide, normal.to(torch.float16))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("convention", ["modelopt_dec", "ct_enc", "pow2"])
def test_quantize_random_matches_vllm(device, convention):
    for x in _random_inputs(device):
        amax = x.abs().amax().float()
        if convention == "modelopt_dec":
            gs_dec = amax / (6 * 448)
            packed, scale = nvfp4.quantize(x, gs_dec)
            gs_enc = 1.0 / gs_dec  # what vLLM hands ref_nvfp4_quant for a ModelOpt input_scale
            p2, s2 = _check_quant_vs_vllm(x, gs_enc)
            assert torch.equal(packed, p2) and torch.equal(bits(scale), bits(s2))
        elif convention == "ct_enc":
            _check_quant_vs_vllm(x, 448 * 6 / amax)
        else:
            _check_quant_vs_vllm(x, torch.exp2(torch.round(torch.log2(448 * 6 / amax))))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_dequantize_random_matches_vllm(device, dtype):
    g = torch.Generator().manual_seed(7)
    packed = torch.randint(0, 256, (48, 64), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 0x7F, (48, 8), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    for gs in (1.0, 0.000123, 3.7):
        gs_t = _gs(gs)
        out = nvfp4.dequantize(packed.to(device), scale.to(device), gs_t.to(device), dtype)
        assert_bitwise_equal(out, vllm_nvfp4_dequant(packed, scale, gs_t, dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_activation_qdq_matches_vllm(device):
    for x in _random_inputs(device):
        x2 = x.reshape(-1, x.shape[-1])
        gs_enc = 448 * 6 / x2.abs().amax().float() * 0.5  # some blocks saturate, as with a static scale
        assert_bitwise_equal(nvfp4.qdq_activation(x2, gs_enc), vllm_nvfp4_qdq(x2, gs_enc))


# ---- family 6 and 7: global-scale conventions and dequant order -------------------------------


def test_ct_and_modelopt_global_scales_decode_differently():
    amax = torch.rand(20000, generator=torch.Generator().manual_seed(3)) * 100 + 1e-3
    modelopt = amax / 2688.0
    ct = nvfp4.dec_from_enc(2688.0 / amax)
    assert torch.equal(ct, 1.0 / (2688.0 / amax))  # vLLM's CT decode: fp32(1.0 / gs_enc)
    frac = (ct != modelopt).float().mean().item()
    assert 0.1 < frac < 0.5  # the notes measured 28%: checkpoint bytes, not amax, define gs


@pytest.mark.parametrize("device", DEVICES)
def test_per_expert_global_scale_3d(device):
    g = torch.Generator().manual_seed(11)
    packed = torch.randint(0, 256, (3, 16, 32), dtype=torch.uint8, generator=g)
    scale = torch.randint(0, 0x7F, (3, 16, 4), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    gs = torch.tensor([0.5, 0.013, 7.25], dtype=F32)
    out = nvfp4.dequantize(packed.to(device), scale.to(device), gs.to(device), torch.bfloat16)
    assert_bitwise_equal(out, vllm_nvfp4_dequant(packed, scale, gs, torch.bfloat16))
    x = torch.randn(3, 16, 32, generator=g).to(device)
    p3, s3 = nvfp4.quantize(x, gs.to(device))
    for e in range(3):
        pe, se = nvfp4.quantize(x[e], gs[e].item())
        assert torch.equal(p3[e], pe) and torch.equal(bits(s3[e]), bits(se))


def test_dequant_order_is_vllms_not_prescaled():
    # fp32 output shows the order: e * (s * gs) (vLLM) vs (e * s) * gs, which differ in ~10% of
    # elements (rarely in bf16). One global scale per expert, many experts.
    g = torch.Generator().manual_seed(5)
    packed = torch.randint(0, 256, (256, 4, 64), dtype=torch.uint8, generator=g)
    scale = torch.randint(1, 0x7F, (256, 4, 8), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    gs = torch.rand(256, generator=g) * 1e-3 + 1e-4
    ours = nvfp4.dequantize(packed, scale, gs, F32)
    assert_bitwise_equal(ours, vllm_nvfp4_dequant(packed, scale, gs, F32))
    e = nvfp4.unpack_values(packed).reshape(256, 4, 8, 16)
    prescaled = ((e * scale.float().unsqueeze(-1)) * gs[:, None, None, None]).reshape(256, 4, 128)
    assert (bits(ours) != bits(prescaled)).sum() > 100


# ---- family 9: swizzle ------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_swizzle_padding_m130_k80(device):
    g = torch.Generator().manual_seed(9)
    s = torch.randint(1, 0x7F, (130, 5), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn).to(device)
    sw = nvfp4.swizzle_scales(s)
    assert sw.shape == (256, 8) and sw.dtype == torch.float8_e4m3fn
    # vLLM slices the columns with k (elements) instead of k/16, so it returns the padded width
    # whenever K/16 is not a multiple of 4; its extra columns must be the zero padding.
    lin = nvfp4_emulation_utils.convert_swizzled_to_linear(sw.cpu(), 130, 80, 16)
    assert lin.shape == (130, 8)
    assert torch.equal(bits(lin[:, :5]), bits(s)) and not bits(lin[:, 5:]).any()
    # all padding is zero: exactly the 130*5 real entries are non-zero
    assert int((sw.view(torch.uint8) != 0).sum()) == 130 * 5
    # vLLM's forward swizzle for MX scales uses the same 128x4 layout and runs on CPU
    ref = mxfp8_utils.swizzle_mxfp8_scale(s.view(torch.uint8).cpu(), M=130, K=5 * 32)
    assert torch.equal(bits(sw).reshape(-1), ref)
    assert torch.equal(bits(nvfp4.unswizzle_scales(sw, 130, 80)), bits(s))
    assert torch.equal(bits(nvfp4.unswizzle_scales(sw.reshape(-1), 130, 80)), bits(s))


@given(st.integers(1, 300), st.integers(1, 12), st.integers(1, 2))
@settings(max_examples=40, deadline=None)
def test_swizzle_round_trip(m, c, batch):
    s = torch.randint(0, 256, (batch, m, c), dtype=torch.uint8)
    sw = nvfp4.swizzle_scales(s)
    assert torch.equal(nvfp4.unswizzle_scales(sw, m, 16 * c), s)
    ref = nvfp4_emulation_utils.convert_swizzled_to_linear(sw[0], m, 16 * c, 16)
    assert torch.equal(ref[:, :c], s[0]) and not ref[:, c:].any()  # see the M=130 test


# ---- properties ----------------------------------------------------------------------------


@given(st.floats(-7.0, 7.0, width=32))
@settings(max_examples=300, deadline=None)
def test_e2m1_codes_are_nearest_even(v):
    code = e2m1_codes(torch.tensor([v], dtype=F32).clamp(-6, 6)).item()
    assert code == e2m1_code_rne(max(-6.0, min(6.0, v)))


@st.composite
def _quantized_blocks(draw):
    n_blocks = draw(st.integers(1, 4))
    codes = draw(st.lists(st.integers(0, 15), min_size=16 * n_blocks, max_size=16 * n_blocks))
    codes = torch.tensor(codes, dtype=torch.uint8).reshape(1, n_blocks, 16)
    pos = draw(st.lists(st.integers(0, 15), min_size=n_blocks, max_size=n_blocks))
    for b, p in enumerate(pos):  # each block holds a +-6 so its amax pins the scale
        codes[0, b, p] = 7 | (codes[0, b, p] & 8)
    scale = draw(st.lists(st.integers(1, 0x7E), min_size=n_blocks, max_size=n_blocks))
    gs = draw(st.floats(2.0**-20, 2.0**10, width=32))
    return codes.reshape(1, -1), torch.tensor([scale], dtype=torch.uint8).view(torch.float8_e4m3fn), gs


@given(_quantized_blocks())
@settings(max_examples=150, deadline=None)
def test_quantize_dequantize_round_trip(block):
    codes, scale, gs = block
    x = nvfp4.dequantize(nvfp4.pack_codes(codes), scale, gs, F32)
    packed2, scale2 = nvfp4.quantize(x, gs)
    canonical = torch.where(codes == 8, 0, codes)  # -0 decodes to -0.0 and re-encodes as +0
    assert torch.equal(bits(scale2), bits(scale))
    assert torch.equal(nvfp4.unpack_codes(packed2), canonical)


# ---- bad input -----------------------------------------------------------------------------


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match=r"x has shape \(4, 20\)"):
        nvfp4.quantize(torch.zeros(4, 20), 1.0)
    with pytest.raises(ValueError, match=r"packed has shape \(4, 8\) and scale \(4, 2\)"):
        nvfp4.dequantize(torch.zeros(4, 8, dtype=torch.uint8), torch.zeros(4, 2, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"global_scale_dec has shape \(3,\)"):
        nvfp4.quantize(torch.zeros(2, 16), torch.ones(3))
    with pytest.raises(ValueError, match="exactly one"):
        nvfp4.quantize(torch.zeros(2, 16))
    with pytest.raises(ValueError, match="finite and > 0"):
        nvfp4.quantize(torch.zeros(2, 16), 0.0)
    with pytest.raises(ValueError, match="swizzled scale has shape"):
        nvfp4.unswizzle_scales(torch.zeros(100, dtype=torch.uint8), 130, 80)
