"""MXFP8 codec vs vLLM ``_mxfp8_e4m3_quantize_torch`` / ``dequant_mxfp8_to_bf16`` (notes section 8,
families 10, 11)."""

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
    mxfp8_utils,
    vllm_mxfp8_dequant,
    vllm_mxfp8_quant,
)

from quant import mxfp8

F32 = torch.float32


def _check_vs_vllm(x: torch.Tensor):
    q, s = mxfp8.quantize(x)
    rq, rs = vllm_mxfp8_quant(x)
    assert_bitwise_equal(s, rs)
    assert_bitwise_equal(q, rq)
    return q, s


def _block(amax: float, fill: float = 1.0) -> list[float]:
    return [amax] + [fill] * 31


# ---- family 10: E8M0 scale corners -----------------------------------------------------------


def _f32_above(v: float) -> float:
    return float(np.nextafter(np.float32(v), np.float32(np.inf)))


# (block amax, expected byte). vLLM: clamp(ceil(log2(max(a, 2^-126) / 448)) + 127, 0, 254).
SCALE_CASES = [
    (448.0, 127),
    (1.75, 119),  # 1.75 = 448 * 2^-8: scale 2^(k-8) (compressed-tensors picks 2^(k-7))
    (1.75 * 2**20, 139),
    (1.7578125, 120),  # just above 1.75 * 2^k: next exponent up, no saturation (torchao FLOOR saturates)
    (0.0, 0),  # zero block
    (1e-39, 0),  # below 448 * 2^-127: byte 0, elements scaled by 2^127 (torchao RCEIL uses 1)
    (3e38, 247),  # the largest byte a finite fp32 amax reaches; only inf gives 254
    (_f32_above(448.0 * 2**-10), 117),  # fp32 amax a hair above 448*2^k: log2 rounds to k ...
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("amax", "byte"), SCALE_CASES)
def test_scale_byte_corners(device, amax, byte):
    x = torch.tensor([_block(amax, amax / 3)], dtype=F32, device=device)
    q, s = _check_vs_vllm(x)
    assert s.item() == byte
    if byte == 117:  # ... so the element lands at 448.00003 and the cast takes it to 448 (0x7E)
        assert q.view(torch.uint8)[0, 0].item() == 0x7E


@pytest.mark.parametrize("device", DEVICES)
def test_byte_0_and_byte_255_decode(device):
    q = torch.tensor([[1.0] + [0.0] * 31, [2.0] + [0.0] * 31], device=device).to(torch.float8_e4m3fn)
    s = torch.tensor([[0], [255]], dtype=torch.uint8, device=device)
    out = mxfp8.dequantize(q, s, torch.bfloat16).cpu()
    assert out[0, 0].item() == 2.0**-127  # a bf16 subnormal, still exact
    assert_bitwise_equal(out[0], vllm_mxfp8_dequant(q, s)[0])
    # E8M0 byte 255 is NaN; vLLM's exp2(128) gives inf (x != 0) or NaN (x == 0). We return NaN.
    assert torch.isnan(out[1]).all()
    assert torch.isnan(mxfp8.e8m0_to_float(torch.tensor([255], dtype=torch.uint8))).all()


# ---- family 11: element rounding --------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
def test_element_ties_and_subnormals(device):
    # amax 448 pins the scale to 2^0, so elements are rounded as they are.
    vals = [448.0, 1.0625, 1.1875, -1.0625, -1.1875, 2**-10, 3 * 2**-10, 5 * 2**-10, 2**-11,
            -(2**-10), 464.0 / 2, 15 * 2**-10, 0.0, -0.0, 240.0, 232.0]
    x = torch.tensor([vals + [0.5] * 16], dtype=F32, device=device)
    q, s = _check_vs_vllm(x)
    assert s.item() == 127
    got = q.float().cpu()[0, :16].tolist()
    assert got[:5] == [448.0, 1.0, 1.25, -1.0, -1.25]
    # subnormal ties (step 2^-9): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, 7.5 -> 8 (= 2^-6, the first normal)
    assert got[5:12] == [0.0, 2**-8, 2**-8, 0.0, 0.0, 224.0, 2**-6]
    assert math.copysign(1.0, got[9]) == -1.0  # -2^-10 rounds to -0
    assert got[14:16] == [240.0, 224.0]  # 232 is the tie between 224 and 240 -> even mantissa


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_blocks(device):
    x = torch.tensor(
        [_block(math.nan), _block(math.inf, -2.0), _block(-math.inf, 0.0), _block(3.0)], device=device
    )
    q, s = mxfp8.quantize(x)
    assert s.cpu().tolist() == [[255], [254], [254], [127 - 7]]
    assert torch.isnan(q.float()[0]).all()
    assert q.float()[1, 0].item() == 448.0 and q.float()[2, 0].item() == -448.0  # saturated
    out = mxfp8.dequantize(q, s, F32)
    assert torch.isnan(out[0]).all() and not torch.isnan(out[1:]).any()
    # the finite block is what vLLM gives; vLLM leaves NaN undefined and inf torch-version dependent
    rq, rs = vllm_mxfp8_quant(x[3:])
    assert_bitwise_equal(q[3:], rq) and assert_bitwise_equal(s[3:], rs)


# ---- random tensors ----------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_quantize_random_matches_vllm(device, dtype):
    g = torch.Generator().manual_seed(21)
    exps = torch.randint(-40, 40, (64, 1), generator=g).float()
    if dtype == torch.float16:
        exps = exps.clamp(-10, 10)
    x = torch.randn(64, 256, generator=g) * torch.exp2(exps)
    x[5] = 0.0
    x[6, :32] = 1e-40 if dtype != torch.float16 else 0.0
    _check_vs_vllm(x.to(dtype).to(device))
    x3 = torch.randn(2, 8, 64, generator=g).to(dtype).to(device)
    _check_vs_vllm(x3)


@pytest.mark.parametrize("device", DEVICES)
def test_dequantize_random_matches_vllm(device):
    g = torch.Generator().manual_seed(22)
    qb = torch.randint(0, 256, (32, 128), dtype=torch.uint8, generator=g)
    qb = torch.where((qb & 0x7F) == 0x7F, 0, qb)  # no NaN elements
    q = qb.view(torch.float8_e4m3fn)
    s = torch.randint(0, 255, (32, 4), dtype=torch.uint8, generator=g)
    assert_bitwise_equal(mxfp8.dequantize(q.to(device), s.to(device)), vllm_mxfp8_dequant(q, s))
    # and fp32 output is the exact product (for bytes <= 246, where 448 * 2^(b-127) fits fp32)
    s = s.clamp(max=246)
    exact = q.double().reshape(32, 4, 32) * torch.exp2(s.double() - 127).unsqueeze(-1)
    assert torch.equal(mxfp8.dequantize(q.to(device), s.to(device), F32).cpu().double(), exact.reshape(32, 128))


def test_swizzle_matches_vllm():
    s = torch.randint(0, 255, (130, 5), dtype=torch.uint8)
    sw = mxfp8.swizzle_scales(s)
    assert torch.equal(sw.reshape(-1), mxfp8_utils.swizzle_mxfp8_scale(s, M=130, K=160))
    assert torch.equal(mxfp8.unswizzle_scales(sw, 130, 160), s)


# ---- properties ----------------------------------------------------------------------------


@st.composite
def _mx_blocks(draw):
    n = draw(st.integers(1, 3))
    elems = draw(st.lists(st.integers(0, 255).filter(lambda b: b & 0x7F != 0x7F), min_size=32 * n, max_size=32 * n))
    q = torch.tensor(elems, dtype=torch.uint8).reshape(1, n, 32)
    top = draw(st.lists(st.integers(0x77, 0x7E), min_size=n, max_size=n))  # 240..448 pins the scale
    for b in range(n):
        q[0, b, draw(st.integers(0, 31))] = top[b] | draw(st.sampled_from([0, 0x80]))
    scale = draw(st.lists(st.integers(0, 245), min_size=n, max_size=n))  # 448 * 2^(245-127) < fp32 max
    return q.reshape(1, -1).view(torch.float8_e4m3fn), torch.tensor([scale], dtype=torch.uint8)


@given(_mx_blocks())
@settings(max_examples=150, deadline=None)
def test_quantize_dequantize_round_trip(block):
    q, s = block
    q2, s2 = mxfp8.quantize(mxfp8.dequantize(q, s, F32))
    assert torch.equal(s2, s)
    assert torch.equal(bits(q2), bits(q))


@given(st.lists(st.floats(-1e6, 1e6, width=32), min_size=64, max_size=64))
@settings(max_examples=100, deadline=None)
def test_qdq_is_idempotent(vals):
    x = torch.tensor([vals], dtype=torch.bfloat16)
    once = mxfp8.qdq(x)
    assert once.dtype == torch.bfloat16
    assert torch.equal(mxfp8.qdq(once), once)


def test_bad_shapes_raise_clear_errors():
    with pytest.raises(ValueError, match=r"x has shape \(2, 48\)"):
        mxfp8.quantize(torch.zeros(2, 48))
    q = torch.zeros(2, 64).to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"q has shape \(2, 64\) and scale \(2, 3\)"):
        mxfp8.dequantize(q, torch.zeros(2, 3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="scale has dtype"):
        mxfp8.dequantize(q, torch.zeros(2, 2, dtype=torch.int32))
