"""NVFP4 KV-cache QDQ (notes section 8 family 12, SM100 writer math).

vLLM ships no Python (or CPU) version of the M3 cache writer, so the oracle here is an independent
scalar transcription of the writer formula: numpy fp32 for the divisions and Python RNE for the
E4M3 / E2M1 roundings.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from quant_oracles import DEVICES, assert_bitwise_equal, bits, e2m1_rne, e4m3_rne

from quant.kv_cache import nvfp4_kv_qdq

F32 = torch.float32


def _writer_oracle(x: torch.Tensor, g: float) -> torch.Tensor:
    """Scalar reference of the SM100 writer: one block of 16 at a time."""
    xb = x.to(torch.bfloat16).float().reshape(-1, 16).tolist()
    g32 = np.float32(g)
    out = []
    for block in xb:
        finite = [abs(v) for v in block if not math.isnan(v)]
        amax = max(max(finite, default=0.0), float(np.float32(1e-12)))
        sf = float(np.float32(amax) / (np.float32(6.0) * g32))
        sf = e4m3_rne(min(max(sf, 2.0**-9), 448.0))
        for v in block:
            if math.isnan(v):
                out.append(0.0)
                continue
            q = float(np.abs(np.float32(v) / g32) / np.float32(sf))
            mag = e2m1_rne(min(q, 6.0))
            val = float(np.float32(np.float32(mag * sf) * g32))
            out.append(-val if (v < 0 and mag != 0) else val)
    return torch.tensor(out, dtype=F32).reshape(x.shape).to(x.dtype)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("g", [1.0, 0.37, 3.0, 1e-3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, F32])
def test_random_matches_writer_formula(device, g, dtype):
    gen = torch.Generator().manual_seed(31)
    x = torch.randn(2, 4, 64, generator=gen) * torch.exp2(torch.randint(-12, 6, (2, 4, 1), generator=gen).float())
    x = x.to(dtype).to(device)
    out = nvfp4_kv_qdq(x, g)
    assert out.dtype == dtype and out.shape == x.shape
    assert_bitwise_equal(out, _writer_oracle(x.cpu(), g))


@pytest.mark.parametrize("device", DEVICES)
def test_edge_blocks(device):
    rows = [
        [2688.0, -1.0] + [0.5] * 14,  # amax = 2688 * g: scale exactly 448
        [1e6, -3000.0] + [100.0] * 14,  # above: the scale saturates at 448 and codes clamp at 6
        [6 * 2**-10] + [2**-10] * 15,  # tiny: the 2^-9 scale floor keeps non-zero codes
        [2**-12] * 16,  # |x| / 2^-9 = 0.125 -> everything rounds to 0
        [math.nan, 3.0, -3.0] + [1.0] * 13,  # NaN is left out of amax and stored as 0
        [-0.0, -1e-30] + [0.0] * 14,  # -0 (and values rounding to zero) come back as +0
        [math.inf, -2.0] + [1.0] * 14,
        [1.0625 * 6, 1.0625, 1.1875, 1.25, 1.75, 2.5, 5.0, -5.0] + [0.25] * 8,
    ]
    x = torch.tensor(rows, dtype=F32, device=device)
    out = nvfp4_kv_qdq(x).cpu()
    assert_bitwise_equal(out, _writer_oracle(x.cpu(), 1.0))
    assert out[0, 0].item() == 2688.0
    assert out[1, 0].item() == 2688.0 and out[1, 1].item() == -2688.0
    assert out[2, 1].item() == 2**-10
    assert torch.all(bits(out[3]) == 0) and torch.all(bits(out[5]) == 0)
    assert out[4, 0].item() == 0.0 and out[4, 1].item() == 3.0
    assert out[6, 0].item() == 6 * 448.0
    assert out[7].tolist()[:8] == [6.0, 1.0, 1.0, 1.0, 2.0, 2.0, 4.0, -4.0]  # scale 1.0625 -> 1


def test_input_is_rounded_to_bf16_first():
    # In fp32 these sit just off the E2M1 ties; bf16 rounding moves them onto the tie, which then
    # goes to the even code: 0.749 -> 0.75 -> 1.0 (not 0.5), 1.251 -> 1.25 -> 1.0 (not 1.5).
    x = torch.tensor([[6.0, 0.75 - 2**-10, 1.25 + 2**-10] + [0.0] * 13], dtype=F32)
    out = nvfp4_kv_qdq(x)
    assert out[0, 1:3].tolist() == [1.0, 1.0]
    assert_bitwise_equal(out, _writer_oracle(x, 1.0))


@pytest.mark.parametrize("device", DEVICES)
def test_straight_through_gradient(device):
    x = torch.randn(3, 32, device=device, requires_grad=True)
    g = torch.randn(3, 32, device=device)
    (nvfp4_kv_qdq(x, torch.tensor(0.5)) * g).sum().backward()
    assert torch.equal(x.grad, g)


@pytest.mark.parametrize("bad", [0.0, -1.0, math.inf, math.nan])
def test_bad_scale_raises(bad):
    with pytest.raises(ValueError, match="KV-cache scale must be finite and > 0"):
        nvfp4_kv_qdq(torch.zeros(2, 16), bad)


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match=r"x has shape \(4, 72\)"):
        nvfp4_kv_qdq(torch.zeros(4, 72))
    with pytest.raises(ValueError, match=r"global_scale has shape \(2,\)"):
        nvfp4_kv_qdq(torch.zeros(4, 16), torch.ones(2))
