"""m3.ops.swigluoai_uninterleave: clamp's values, and one gradient convention at the limits on every torch."""

import torch

from m3.ops import swigluoai_uninterleave

ALPHA, LIMIT, BETA = 1.702, 7.0, 1.0


def _clamp_chain(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    gate, up = gate.clamp(max=LIMIT), up.clamp(min=-LIMIT, max=LIMIT)
    return gate * torch.sigmoid(ALPHA * gate) * (up + BETA)


def test_values_are_clamps_for_every_bf16_gate_and_up():
    every = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(-1, 256)
    for gate_up in (torch.cat([every, every.flip(0)], 1), torch.cat([every.float(), every.flip(0).float()], 1)):
        out, ref = swigluoai_uninterleave(gate_up, ALPHA, LIMIT, BETA), _clamp_chain(gate_up)
        assert ((out == ref) | (out.isnan() & ref.isnan())).all()


def test_gradient_passes_at_the_limits_and_stops_beyond():
    """As the fused kernels (rl.model.swiglu_triton) and torch <= 2.13's clamp do; torch 2.14's clamp gives 0 at the
    limit itself, where the CPU and the GPU trainer paths would then disagree."""
    f64 = dict(dtype=torch.float64)
    gate = torch.tensor([LIMIT, LIMIT + 1, 1.0, 1.0, 1.0, 1.0], **f64, requires_grad=True)
    up = torch.tensor([1.0, 1.0, LIMIT, -LIMIT, LIMIT + 1, -LIMIT - 1], **f64, requires_grad=True)
    swigluoai_uninterleave(torch.cat([gate, up]), ALPHA, LIMIT, BETA).sum().backward()
    g = torch.tensor([LIMIT, LIMIT, 1.0, 1.0, 1.0, 1.0], **f64)  # clamped
    u = torch.tensor([1.0, 1.0, LIMIT, -LIMIT, LIMIT, -LIMIT], **f64)
    s = torch.sigmoid(ALPHA * g)
    gate_passes = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0], **f64)  # 0: above the limit
    up_passes = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 0.0], **f64)
    torch.testing.assert_close(gate.grad, (s + g * ALPHA * s * (1 - s)) * (u + BETA) * gate_passes)
    torch.testing.assert_close(up.grad, g * s * up_passes)
