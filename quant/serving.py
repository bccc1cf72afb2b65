"""The frozen quantized linears the trainer builds from checkpoint tensors (``NVFP4Linear``, ``MXFP8Linear``),
each running its serving form, and those forms as functions (defined in ``quant.forms``, re-exported here so that
``quant.serving`` is the one import for both).

``MXFP8Linear`` runs the "hopper" form of a bf16 model on CUDA through ``quant.kernels.mxfp8_linear`` (a Triton
dequantize + cuBLAS: the same form, faster); everywhere else through ``quant.forms.mxfp8_linear``. The kernels depend
on ``quant.forms``, never on this module, so the dependency points one way.
"""

from __future__ import annotations

import torch

from quant import forms
from quant.forms import (
    PROFILES,
    Profile,
    check_profile,
    fused_w13_global_scale,
    marlin_flush_scales,
    marlin_scale_factor,
    mxfp8_act_qdq,
    mxfp8_linear,
    nvfp4_act_qdq,
    nvfp4_linear,
    nvfp4_weight,
)
from quant.kernels.mxfp8_linear import mxfp8_linear as _hopper_mxfp8_linear

__all__ = ["MXFP8Linear", "NVFP4Linear", *forms.__all__]

# ---------------------------------------------------------------------------------------------
# Modules holding frozen checkpoint tensors


class NVFP4Linear(torch.nn.Module):
    """Frozen NVFP4 linear holding the checkpoint tensors as buffers (no trainable parameters)."""

    def __init__(
        self,
        packed: torch.Tensor,
        scale: torch.Tensor,
        global_scale_dec: float | torch.Tensor,
        *,
        input_global_scale_enc: float | torch.Tensor | None = None,
        profile: Profile = "hopper",
        marlin_flush: bool = False,
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.profile = check_profile(profile)
        self.dtype = dtype
        if marlin_flush:
            scale = marlin_flush_scales(scale, dtype)
        self.register_buffer("packed", packed)
        self.register_buffer("scale", scale.view(torch.float8_e4m3fn))
        self.register_buffer("global_scale", torch.as_tensor(global_scale_dec, dtype=torch.float32).clone())
        gs_in = input_global_scale_enc
        if gs_in is not None:
            gs_in = torch.as_tensor(gs_in, dtype=torch.float32).clone()
        self.register_buffer("input_global_scale_enc", gs_in)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        return nvfp4_linear(
            x, self.packed, self.scale, self.global_scale, self.profile,
            input_global_scale_enc=self.input_global_scale_enc, dtype=self.dtype,
        )


class MXFP8Linear(torch.nn.Module):
    """Frozen MXFP8 linear; the bf16 weight is rebuilt each forward to keep memory at 1 B/param."""

    def __init__(
        self,
        weight: torch.Tensor,
        scale: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        profile: Profile = "hopper",
        dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.profile = check_profile(profile)
        self.dtype = dtype
        self.register_buffer("weight", weight)
        self.register_buffer("scale", scale)
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # noqa: D102
        if x.is_cuda and self.profile == "hopper" and self.dtype == torch.bfloat16:
            return _hopper_mxfp8_linear(x, self.weight, self.scale.view(torch.uint8), self.bias)
        # .view: the E8M0 bytes may be held in a 1-byte float container (FSDP2 sharding, rl/fsdp.py)
        return mxfp8_linear(x, self.weight, self.scale.view(torch.uint8), self.profile, bias=self.bias,
                            dtype=self.dtype)
