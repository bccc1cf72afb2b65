"""quant.kernels.nvfp4_dequant on CPU: the Triton decode under Triton's interpreter (a subprocess with the
interpreter-only Triton of scripts/install/setup_env.sh on its path) is bit-identical to quant.forms.nvfp4_weight
on every code and scale byte (subnormal and NaN scales too); the per-expert chunked GEMM loop (chunks, empty experts,
forward and input gradient, the forward's decoded weights kept for the input gradient) matches the reference
expert loop. Their CUDA runs: tests/quant/test_kernels_gpu.py.
"""

import json
import sys

import pytest
import torch

from quant import forms
from quant.kernels import nvfp4_moe as moe
from quant.kernels.nvfp4_dequant import dequant_dgrad, dequant_fwd
from tests.triton_interpreter import run_under_interpreter


def _every_byte(e=3, n=16, k=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    packed.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every code pair
    scale = torch.randint(0, 256, (e, n, k // 16), dtype=torch.uint8, generator=g)
    scale.view(-1)[:256] = torch.arange(256, dtype=torch.uint8)  # every scale byte: zero, subnormal, NaN
    return packed, scale


if __name__ == "__main__":  # the interpreter subprocess
    from quant.kernels.nvfp4_dequant import launch_decode

    cases = {}
    # every byte; and an odd shape whose 16-code groups (9 x 33) end inside a program's last row of 4 groups
    for name, (e, n, k) in {"every_byte": (3, 16, 512), "partial_row": (1, 9, 528)}.items():
        packed, scale = _every_byte(e, n, k)
        out = torch.full((*packed.shape[:-1], packed.shape[-1] * 2), float("nan"), dtype=torch.bfloat16)
        launch_decode(packed, scale, out, asm=False, rows=4)
        ref = forms.nvfp4_weight(packed, scale.view(torch.float8_e4m3fn), torch.bfloat16)
        nan = torch.isnan(ref)
        cases[name] = {"same_nan": bool(torch.equal(torch.isnan(out), nan)),
                       "bits_equal": bool(torch.equal(out.view(torch.int16)[~nan], ref.view(torch.int16)[~nan])),
                       "nan_count": int(nan.sum()), "n": out.numel()}
    print(json.dumps(cases))
    sys.exit(0)


def test_decode_under_the_interpreter_is_bit_exact(triton_version):
    cases = run_under_interpreter(__file__, triton=triton_version)
    assert set(cases) == {"every_byte", "partial_row"}, cases
    for r in cases.values():
        assert r["same_nan"] and r["bits_equal"], cases
        assert r["nan_count"] > 0  # NaN scales (0x7F, 0xFF) were among the inputs


@pytest.mark.parametrize("chunk", [1, 2, 8])
def test_chunked_expert_gemms_match_the_reference(chunk):
    g = torch.Generator().manual_seed(chunk)
    e, n, k = 5, 48, 64
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(0x28, 0x48, (e, n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    gs = torch.rand(e, generator=g) * 0.01 + 1e-3
    counts = [7, 0, 0, 12, 3]
    offsets = moe.expert_offsets(torch.tensor(counts))
    bounds = offsets.tolist()
    x = torch.randn(bounds[-1], k, generator=g).bfloat16()
    dy = torch.randn(bounds[-1], n, generator=g).bfloat16()
    y = dequant_fwd(x, packed, scale, gs.tolist(), bounds, chunk=chunk)
    dx = dequant_dgrad(dy, packed, scale, gs.tolist(), bounds, chunk=chunk)
    # the forward's decoded weights kept for the input gradient: the same results, bit for bit
    kept = torch.full((e, n, k), float("nan"), dtype=torch.bfloat16)
    assert torch.equal(dequant_fwd(x, packed, scale, gs.tolist(), bounds, chunk=chunk, into=kept), y)
    assert torch.equal(dequant_dgrad(dy, packed, scale, gs.tolist(), bounds, chunk=chunk, decoded=kept), dx)
    ref_y = moe.nvfp4_moe_linear_reference(x, packed, scale, gs, offsets)
    ref_dx = torch.cat([(forms._mm_fp32(dy[a:b], forms.nvfp4_weight(packed[i], scale[i]).t()) * gs[i])
                        .bfloat16() for i, (a, b) in enumerate(zip(bounds, bounds[1:]))])
    for got, ref in ((y, ref_y), (dx, ref_dx)):
        assert got.shape == ref.shape
        rel = float((got.float() - ref.float()).norm() / ref.float().norm())
        assert rel <= 2.0**-8, rel


@pytest.mark.parametrize("version", [(3, 6), (3, 7), (3, 8), (3, 9)])
def test_path_picks_by_rows_per_expert_and_device(monkeypatch, version):
    """The per-call path: the fused kernels below DEQUANT_MIN_ROWS rows per expert, decode + cuBLAS from there (the
    forward from FWD_DEQUANT_MIN_ROWS_TRITON_3_8 under Triton 3.8+, unless DEQUANT_MIN_ROWS asks for fewer); the
    input gradient's threshold is "dgrad_gluon" where the Gluon kernel runs (sm_90), and never on CPU tensors."""
    from quant.kernels import nvfp4_moe_gemm as gemm

    monkeypatch.setattr(moe, "triton_version", lambda: version)
    monkeypatch.setattr(gemm, "triton_version", lambda: version)
    e, rows = 128, dict(moe.DEQUANT_MIN_ROWS)
    fwd = moe.FWD_DEQUANT_MIN_ROWS_TRITON_3_8 if version >= (3, 8) else rows["fwd"]
    assert fwd == (512 if version >= (3, 8) else 768)
    assert moe._pick(None, fwd * e - 1, e, "fwd") == "kernel"
    assert moe._pick(None, fwd * e, e, "fwd") == "dequant"
    monkeypatch.setitem(moe.DEQUANT_MIN_ROWS, "fwd", 0)  # the trainer's GPU test forces the decode path this way
    assert moe._pick(None, 1, e, "fwd") == "dequant"
    assert moe._pick(None, rows["dgrad"] * e, e, "dgrad", gluon=False) == "dequant"
    assert moe._pick(None, rows["dgrad_gluon"] * e - 1, e, "dgrad", gluon=True) == "kernel"
    assert moe._pick(None, rows["dgrad_gluon"] * e, e, "dgrad", gluon=True) == "dequant"
    assert moe._pick("kernel", 10**9, e, "dgrad") == "kernel" and moe._pick("dequant", 1, e, "fwd") == "dequant"
    cpu = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert not gemm.gluon_available(cpu) and not gemm.gluon_dgrad_default(cpu, 10**6, e)
    assert not gemm.gluon_fwd_default(cpu, 10**6, e)
    assert not gemm.gluon_dgrad_device(cpu, None) and not gemm.gluon_dgrad_device(cpu, "triton")


def test_input_gradient_accumulates_into_a_given_tensor():
    """dequant_dgrad(accumulate=acc): acc + dx in place, rounded once (cuBLAS's beta = 1 epilogue): within one bf16
    rounding of the fp32 sum, closer to it than rounding dx first and adding (autograd's sum of two gradients);
    a tensor of the wrong dtype or shape is refused before any work."""
    g = torch.Generator().manual_seed(5)
    e, n, k = 4, 32, 64
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(0x28, 0x48, (e, n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    gs = torch.rand(e, generator=g) * 0.01 + 1e-3
    bounds = moe.expert_offsets(torch.tensor([6, 0, 9, 5])).tolist()
    dy = torch.randn(bounds[-1], n, generator=g).bfloat16()
    acc = (torch.randn(bounds[-1], k, generator=g) * 0.05).bfloat16()
    dx = dequant_dgrad(dy, packed, scale, gs.tolist(), bounds)
    into = acc.clone()
    got = dequant_dgrad(dy, packed, scale, gs.tolist(), bounds, accumulate=into)
    assert got.data_ptr() == into.data_ptr()
    exact = torch.cat([forms._mm_fp32(dy[a:b], forms.nvfp4_weight(packed[i], scale[i]).t()) * gs[i]
                       for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]) + acc.float()
    err_fused = float((got.float() - exact).norm() / exact.norm())
    err_twice = float(((dx + acc).float() - exact).norm() / exact.norm())
    assert err_fused <= 2.0**-8, err_fused
    assert err_fused <= err_twice, (err_fused, err_twice)
    assert not torch.equal(got, acc)  # the base's gradient reached it
    for bad in (acc.float(), acc[:-1].clone(), acc.t().contiguous().t()):
        with pytest.raises(ValueError, match="accumulate"):
            dequant_dgrad(dy, packed, scale, gs.tolist(), bounds, accumulate=bad)
