"""rl.model.lean_triton (the add + RMSNorm, q/k norm + RoPE and weighted-rows backwards) against rl.model.lean's
torch backwards.

CPU: the kernel under Triton's interpreter (a subprocess under each supported Triton, tests/triton_interpreter.py), fp32
inputs (bound: fp32 sums in another order) and bf16 (the roundings), a row width that is not a power of two, each
incoming gradient alone; partial rotary channels (rot < D); the weighted rows' gradient bit-equal where torch makes one
product and one rounding, the weight's as fp32 sums.
GPU (`-m gpu`): the same at M3's sizes (hidden 6144; 64 heads of 128, 64 rotary channels), 4099 rows.
"""

import json
import sys

import pytest
import torch

from tests.triton_interpreter import run_under_interpreter


def _cases(device, rows, h, run):
    from rl.model import lean

    gen = torch.Generator().manual_seed(0)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        x, r, gn, gr = (torch.randn(rows, h, generator=gen).to(device, dtype) for _ in range(4))
        w1 = (1 + torch.randn(h, generator=gen) * 0.1).to(device)
        rs = torch.rsqrt((x.float() + r.float()).pow(2).mean(-1, keepdim=True) + 1e-6)
        for grads in ("both", "normed", "res"):
            a, b = (gn if grads != "res" else None), (gr if grads != "normed" else None)
            ref = lean._add_norm_grad(x, r, w1, rs, a, b).to(dtype).float()  # the torch backward's chunk
            got = run(x, r, w1, rs, a, b).float()
            out[f"{str(dtype)[6:]}_{grads}"] = float((got - ref).norm() / ref.norm())
    return out


def _norm_rope_cases(device, rows, heads, d, rot, run):
    from rl.model import lean

    gen = torch.Generator().manual_seed(2)
    out, half = {}, rot // 2
    for dtype in (torch.float32, torch.bfloat16):
        x, g_out = (torch.randn(rows, heads, d, generator=gen).to(device, dtype) for _ in range(2))
        w1 = (1 + torch.randn(d, generator=gen) * 0.1).to(device)
        ang = torch.rand(rows, half, generator=gen) * 6.3
        # a wider table than rot (columns past it unused): the kernel must follow the row stride
        cos_sin = torch.cat([ang.cos(), ang.sin(), torch.randn(rows, 3, generator=gen)], 1).to(device, dtype)
        rs = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        ref = lean._norm_rope_grad(x, w1, rs, cos_sin, rot, g_out)  # the torch backward's chunk, before its store
        got = run(x, w1, rs, cos_sin, rot, g_out).float()
        out[f"{str(dtype)[6:]}_norm_rope"] = float((got - ref).norm() / ref.norm())
    return out


def _weighted_rows_cases(device, rows, h, run):
    from rl.model import lean

    gen = torch.Generator().manual_seed(1)
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        y = torch.randn(rows, h, generator=gen).to(device, dtype)
        g, w = torch.randn(rows, h, generator=gen).to(device), torch.rand(rows, generator=gen).to(device)
        (gy, gw), (ref_gy, ref_gw) = run(g, y, w), lean._weighted_rows_grad(g, y, w)
        name = str(dtype)[6:]
        out[f"{name}_weighted_rows_gy_equal"] = bool(torch.equal(gy, ref_gy))  # one fp32 product, one rounding
        out[f"{name}_weighted_rows_gw"] = float((gw - ref_gw).norm() / ref_gw.norm())
    return out


if __name__ == "__main__":  # the interpreter subprocess
    from rl.model import lean_triton

    print(json.dumps({**_cases("cpu", 5, 100, lean_triton.add_norm_backward),
                      **_weighted_rows_cases("cpu", 5, 100, lean_triton.weighted_rows_backward),
                      **_norm_rope_cases("cpu", 5, 3, 32, 16, lean_triton.norm_rope_backward)}))
    sys.exit(0)


def _check(report, bf16_bound):
    for name, r in report.items():
        if name.endswith("_equal"):
            assert r is True, (name, report)
        elif name.endswith("_gw"):  # fp32 row sums in another order
            assert r <= 1e-6, (name, r)
        else:
            assert r <= (1e-6 if name.startswith("float32") else bf16_bound), (name, r)


def test_row_backwards_under_the_interpreter_match_torch(triton_version):
    # the interpreter truncates casts to bf16: up to 2 roundings apart
    _check(run_under_interpreter(__file__, triton=triton_version), 8e-3)


@pytest.mark.gpu
def test_row_backwards_match_torch_gpu():
    from rl.model import lean_triton

    report = {**_cases("cuda", 4099, 6144, lean_triton.add_norm_backward),
              **_weighted_rows_cases("cuda", 4099, 6144, lean_triton.weighted_rows_backward),
              **_norm_rope_cases("cuda", 4099, 64, 128, 64, lean_triton.norm_rope_backward)}
    print(json.dumps(report))
    _check(report, 4e-3)  # both round to nearest once: about one bf16 rounding (2^-9) apart
