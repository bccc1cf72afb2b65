"""The M3 math the trainer and the engine plugin must compute identically: partial NeoX RoPE, the swigluoai MoE
activation, and MSA's block constants. Plain torch, so the trainer imports it without vLLM."""

import torch

MSA_BLOCK = 128  # MSA block = vLLM's sparse KV page; the only block size its kernels support
FORCED_INIT_SCORE = 1e30  # init blocks are forced first ...
FORCED_LOCAL_SCORE = 1e29  # ... then the local (most recent) blocks; local wins when a block is both
NAN_SCORE = -1e30  # a NaN index score ranks below every real block


def neox_rope(x: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """Partial NeoX RoPE on the first `rotary_dim` channels; x [N, heads, D], cos_sin [N, rotary_dim] = [cos|sin]."""
    half = rotary_dim // 2
    cos = cos_sin[:, None, :half].float()
    sin = cos_sin[:, None, half:rotary_dim].float()
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:rotary_dim]
    rotated = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., rotary_dim:]], dim=-1)
    return rotated.to(x.dtype)


def swigluoai_uninterleave(gate_up: torch.Tensor, alpha: float, limit: float, beta: float = 1.0) -> torch.Tensor:
    """M3's MoE activation on `[gate | up]` halves: `g*sigmoid(alpha*g)*(u+beta)` with g<=limit, |u|<=limit."""
    gate, up = gate_up.chunk(2, dim=-1)
    # clamp's values, with the gradient passed at the limits themselves on every torch (2.14 made clamp's gradient 0
    # there; the fused kernels of rl.model.swiglu_triton pass it, as torch did before); NaN propagates as in clamp
    gate = torch.where(gate > limit, limit, gate)
    up = torch.where(up > limit, limit, torch.where(up < -limit, -limit, up))
    return gate * torch.sigmoid(alpha * gate) * (up + beta)
