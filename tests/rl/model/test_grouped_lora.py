"""Grouped expert LoRA (rl.model.lora.grouped_lora_delta over quant.kernels.grouped) against the per-expert loop the CPU
path runs (ExpertLoRA.gate_up / .down on each expert's rows): forward, input gradient and both LoRA gradients, with
empty experts. fp32: the same products summed in another order, so fp32 rounding only. bf16 with bf16-valued
masters: the same operands and rounding points as lora_delta, so within a few bf16 ulps. torch._grouped_mm (the
CUDA path) also runs here where this torch has it on CPU, which checks its layouts and offsets without a GPU.
"""

import pytest
import torch

from quant.kernels.grouped import grouped_mm, grouped_mm_t
from rl.model.lora import ExpertLoRA, LoRAConfig

COUNTS = [5, 0, 17, 1, 0, 9]  # rows per expert, two empty


def _torch_cpu_grouped_mm() -> bool:
    try:
        x = torch.ones(4, 8, dtype=torch.bfloat16)
        torch._grouped_mm(x, torch.ones(2, 8, 8, dtype=torch.bfloat16), offs=torch.tensor([1, 4], dtype=torch.int32))
        return True
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


IMPLS = ["loop"] + (["torch"] if _torch_cpu_grouped_mm() else [])


def _offsets(counts):
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def _setup(dtype, hidden=64, inter=48, rank=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    lora = ExpertLoRA(len(COUNTS), hidden, inter, LoRAConfig(rank=rank, alpha=2.0 * rank))
    with torch.no_grad():
        for p in lora.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            if dtype == torch.bfloat16:  # masters exactly representable in the compute dtype: identical operands
                p.copy_(p.to(torch.bfloat16).float())
    offsets = _offsets(COUNTS)
    x = torch.randn(int(offsets[-1]), hidden, generator=g).to(dtype)
    return lora, offsets, x


def _loop(lora, x, offsets, which):
    bounds = offsets.tolist()
    fn = lora.gate_up if which == "gate_up" else lora.down
    return torch.cat([fn(x[a:b], e) for e, (a, b) in enumerate(zip(bounds, bounds[1:]))])


def _grads(lora, x, offsets, which, impl=None):
    x = x.clone().requires_grad_(True)
    lora.zero_grad(set_to_none=True)
    if impl is None:
        y = _loop(lora, x, offsets, which)
    else:
        y = getattr(lora, f"{which}_grouped")(x, offsets, impl=impl)
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(7)).to(y.dtype)
    y.backward(g)
    names = ("gate_up_A", "gate_up_B") if which == "gate_up" else ("down_A", "down_B")
    return [y.detach(), x.grad] + [getattr(lora, n).grad.clone() for n in names]


def _rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30))


# torch._grouped_mm takes bf16 only (fp32 runs the loop): that pair is not a case
CASES = [(impl, dtype) for impl in IMPLS for dtype in (torch.float32, torch.bfloat16)
         if not (impl == "torch" and dtype == torch.float32)]


@pytest.mark.parametrize("impl,dtype", CASES)
@pytest.mark.parametrize("which", ["gate_up", "down"])
def test_grouped_lora_matches_the_per_expert_loop(impl, which, dtype):
    lora, offsets, x = _setup(dtype)
    if which == "down":
        x = torch.randn(x.shape[0], 48, generator=torch.Generator().manual_seed(3)).to(dtype)
    ref = _grads(lora, x, offsets, which)
    got = _grads(lora, x, offsets, which, impl)
    bound = 1e-6 if dtype == torch.float32 else 4e-3  # bf16: dA is rounded to bf16 (the loop keeps it fp32)
    for name, a, b in zip(("y", "dx", "dA", "dB"), got, ref):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert torch.isfinite(a).all(), name
        assert _rel(a, b) <= bound, f"{name}: rel {_rel(a, b):.2e} > {bound}"
    # empty experts get exactly zero LoRA gradients
    for g in got[2:]:
        assert g[1].abs().max() == 0 and g[4].abs().max() == 0


def test_fp32_masters_in_bf16_stay_close_to_the_loop():
    """fp32 masters with bf16 activations: the grouped path rounds A to bf16 (the engine's adapter dtype)."""
    lora, offsets, x = _setup(torch.float32, seed=2)
    x = x.to(torch.bfloat16)
    ref = _grads(lora, x, offsets, "gate_up")
    got = _grads(lora, x, offsets, "gate_up", IMPLS[-1])
    for name, a, b in zip(("y", "dx", "dA", "dB"), got, ref):
        assert _rel(a, b) <= 1e-2, f"{name}: rel {_rel(a, b):.2e}"


@pytest.mark.parametrize("impl", IMPLS)
def test_grouped_mm_shapes_and_values(impl):
    g = torch.Generator().manual_seed(1)
    offsets = _offsets(COUNTS)
    m = int(offsets[-1])
    a = torch.randn(m, 16, generator=g).bfloat16()
    b = torch.randn(len(COUNTS), 16, 24, generator=g).bfloat16()
    c = torch.randn(m, 24, generator=g).bfloat16()
    y = grouped_mm(a, b, offsets, impl)
    w = grouped_mm_t(a, c, offsets, impl)
    bounds = offsets.tolist()
    for e in range(len(COUNTS)):
        lo, hi = bounds[e], bounds[e + 1]
        ref_y = (a[lo:hi].float() @ b[e].float())
        ref_w = (a[lo:hi].float().t() @ c[lo:hi].float())
        assert _rel(y[lo:hi], ref_y) <= 8e-3 if hi > lo else True
        assert (_rel(w[e], ref_w) <= 8e-3) if hi > lo else bool((w[e] == 0).all())
    with pytest.raises(ValueError):
        grouped_mm(a, b[:-1], offsets, impl)


def test_nvfp4_base_with_lora_is_one_node_with_the_same_gradients():
    """_NVFP4WithGroupedLoRA (the NVFP4 experts and their LoRA as one autograd node, the base's input gradient added
    inside its GEMMs) against the two nodes autograd sums (nvfp4_moe_linear's reference + grouped_lora_delta), here
    on CPU through the decode + GEMM path it takes on CUDA: the same output and LoRA gradients, the input gradient
    within bf16 rounding (one rounding of the sum instead of two)."""
    from quant.kernels import nvfp4_moe as moe
    from rl.model.lora import _NVFP4WithGroupedLoRA

    lora, offsets, x = _setup(torch.bfloat16, hidden=64, inter=48, seed=4)
    g = torch.Generator().manual_seed(9)
    e, n, k = len(COUNTS), 96, 64  # gate_up: [2I, H]
    packed = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, generator=g)
    scale = torch.randint(0x28, 0x48, (e, n, k // 16), dtype=torch.uint8, generator=g).view(torch.float8_e4m3fn)
    gs = torch.rand(e, generator=g) * 0.02 + 1e-3
    gy = torch.randn(x.shape[0], n, generator=g).bfloat16()

    def run(fn):
        xx = x.clone().requires_grad_(True)
        lora.zero_grad(set_to_none=True)
        y = fn(xx)
        y.backward(gy)
        return y.detach(), xx.grad, lora.gate_up_A.grad.clone(), lora.gate_up_B.grad.clone()

    two = run(lambda xx: moe.nvfp4_moe_linear_reference(xx, packed, scale, gs, offsets)
              + lora.gate_up_grouped(xx, offsets, impl="loop"))
    one = run(lambda xx: _NVFP4WithGroupedLoRA.apply(xx, lora.gate_up_A, lora.gate_up_B, offsets, lora.scaling,
                                                     "loop", packed, scale, gs.float(), {"impl": "dequant"}))
    for name, a, b in zip(("y", "dx", "dA", "dB"), one, two):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        assert _rel(a, b) <= (2.0**-7 if name in ("y", "dx") else 1e-6), f"{name}: rel {_rel(a, b):.2e}"
    # the base's share of the input gradient is there (the LoRA's alone is far off)
    lora_only = run(lambda xx: lora.gate_up_grouped(xx, offsets, impl="loop"))
    assert _rel(one[1], lora_only[1]) > 0.1
    # on CPU the public entry falls back to the two nodes
    two_again = run(lambda xx: lora.with_nvfp4_base("gate_up", xx, offsets, packed, scale, gs))
    assert all(torch.equal(a, b) for a, b in zip(two_again, two))
