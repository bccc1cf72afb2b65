"""NVFP4 codec: E2M1 elements in 16-element blocks along the last dim K, one E4M3 scale per block,
one fp32 global scale per tensor (or per expert of a stacked [E, N, K] tensor).

Global-scale conventions (the checkpoint bytes define the model, so both must be reproduced):
- ModelOpt stores the decode multiplier ``weight_scale_2 = amax / (6 * 448)``; x = e2m1 * s * gs_dec.
- compressed-tensors stores the encode scale ``weight_global_scale = 448 * 6 / amax``; vLLM decodes
  with ``gs_dec = fp32(1.0 / gs_enc)`` (``dec_from_enc``), which is not bit-equal to amax / 2688.
- vLLM's activation quantizer takes an encode scale; for ModelOpt checkpoints it computes it as
  ``fp32(1.0 / max(input_scale))`` (``enc_from_dec``).

``quantize`` reproduces vLLM's reference quantizer ``ref_nvfp4_quant`` bit for bit (the CPU / torch
formula; vLLM's Triton kernel divides with the approximate ``div.full.f32`` and can differ on exact
E2M1 ties). Non-finite input, matching vLLM where its float output is defined:
- a block holding NaN gets the NaN scale byte 0x7F and codes 0, so the whole block decodes to NaN
  (vLLM's ``ref_nvfp4_quant`` returns NaN for every element of such a block);
- +-inf saturates: the block scale becomes 448 (explicit clamp, any torch version) and the inf
  elements get code +-6; the finite elements of that block mostly round to 0.
"""

from __future__ import annotations

import torch

from quant._common import (
    E2M1_MAX,
    check_dtype,
    check_last_dim,
    e2m1_codes,
    e2m1_table,
    e2m1_values,
    pack_nibbles,
    swizzle_128x4,
    to_e4m3,
    unpack_nibbles,
    unswizzle_128x4,
)

BLOCK = 16

__all__ = [
    "BLOCK",
    "dec_from_enc",
    "dequantize",
    "e2m1_table",
    "enc_from_dec",
    "pack_codes",
    "qdq_activation",
    "quantize",
    "quantize_codes",
    "swizzle_scales",
    "unpack_codes",
    "unpack_values",
    "unswizzle_scales",
]

GlobalScale = float | torch.Tensor


def pack_codes(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] uint8 E2M1 codes -> [..., K/2] bytes, even element in the low nibble."""
    return pack_nibbles(codes)


def unpack_codes(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] uint8 E2M1 codes (code 8 is -0)."""
    return unpack_nibbles(packed)


def unpack_values(packed: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] E2M1 values (exact in any float dtype)."""
    return e2m1_values(unpack_nibbles(packed)).to(dtype)


def dec_from_enc(gs_enc: GlobalScale) -> torch.Tensor:
    """compressed-tensors encode scale -> the decode multiplier vLLM uses: fp32(1.0 / gs_enc)."""
    return 1.0 / torch.as_tensor(gs_enc, dtype=torch.float32)


def enc_from_dec(gs_dec: GlobalScale) -> torch.Tensor:
    """Decode multiplier (ModelOpt ``input_scale`` / ``weight_scale_2``) -> the encode scale vLLM
    hands to its quantizer: fp32(1.0 / gs_dec). Take the max over experts/shards first, as vLLM
    does (``1.0 / a13_scale.max()``)."""
    return 1.0 / torch.as_tensor(gs_dec, dtype=torch.float32)


def _global_scale(gs: GlobalScale, lead: torch.Size, device: torch.device, name: str) -> torch.Tensor:
    """fp32 global scale shaped to broadcast against per-block tensors [*lead, M, K/16].

    Accepts a Python number, a one-element tensor, or one value per leading index (e.g. [E] for a
    stacked [E, N, K/2] expert tensor). Only Python numbers are range-checked: checking a CUDA
    tensor's value would force a device sync on every call.
    """
    if isinstance(gs, (int, float)):
        if not (gs > 0 and gs != float("inf")):
            raise ValueError(f"{name}={gs!r}: a global scale must be finite and > 0")
        return torch.tensor(float(gs), dtype=torch.float32, device=device)
    if not isinstance(gs, torch.Tensor) or not gs.is_floating_point():
        raise ValueError(f"{name} must be a float or a floating-point tensor, got {type(gs)}")
    gs = gs.to(device=device, dtype=torch.float32)
    if gs.numel() == 1:
        return gs.reshape(())
    if len(lead) >= 1 and tuple(gs.shape) == tuple(lead[:-1]):
        return gs.reshape(*gs.shape, 1, 1)
    raise ValueError(
        f"{name} has shape {tuple(gs.shape)}; expected one element or the leading dims "
        f"{tuple(lead[:-1])} of the quantized tensor"
    )


def _recip_or_1e8(t: torch.Tensor) -> torch.Tensor:
    # vLLM's get_reciprocal: 1 / (t + (t == 0) * 1e8), i.e. 1e-8 where t is zero. The zero case is
    # what makes an all-zero or tiny block (scale byte 0) produce codes 0 instead of NaN.
    return torch.where(t == 0, torch.full_like(t, 1e-8), t.reciprocal())


def _quantize_blocks(
    x: torch.Tensor, gs_enc: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (codes [..., K/16, 16] uint8, block scale [..., K/16] fp32 of e4m3)."""
    xb = x.to(torch.float32).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1)  # NaN propagates: a NaN block gets a NaN scale
    # The Python scalar 1/6 is applied as fp32(1/6) by torch on CPU and CUDA alike; the
    # order gs * (amax * (1/6)) is vLLM's and matters for the rounding.
    scale = to_e4m3(gs_enc * (amax * (1.0 / E2M1_MAX))).to(torch.float32)
    inv_scale = _recip_or_1e8(scale * _recip_or_1e8(gs_enc))
    v = (xb * inv_scale.unsqueeze(-1)).clamp(-E2M1_MAX, E2M1_MAX)
    return e2m1_codes(v), scale


def _resolve_enc(
    x: torch.Tensor, global_scale_dec: GlobalScale | None, global_scale_enc: GlobalScale | None
) -> torch.Tensor:
    if (global_scale_dec is None) == (global_scale_enc is None):
        raise ValueError("pass exactly one of global_scale_dec and global_scale_enc")
    lead = x.shape[:-1]
    if global_scale_enc is not None:
        return _global_scale(global_scale_enc, lead, x.device, "global_scale_enc")
    return 1.0 / _global_scale(global_scale_dec, lead, x.device, "global_scale_dec")


def quantize_codes(
    x: torch.Tensor,
    global_scale_dec: GlobalScale | None = None,
    *,
    global_scale_enc: GlobalScale | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Like ``quantize`` but returns unpacked codes [..., K] (uint8 0..15) and e4m3 scales."""
    check_last_dim(x, "x", BLOCK)
    if not x.is_floating_point():
        raise ValueError(f"x has dtype {x.dtype} (shape {tuple(x.shape)}); expected a float tensor")
    gs_enc = _resolve_enc(x, global_scale_dec, global_scale_enc)
    codes, scale = _quantize_blocks(x, gs_enc)
    return codes.reshape(x.shape), scale.to(torch.float8_e4m3fn)


def quantize(
    x: torch.Tensor,
    global_scale_dec: GlobalScale | None = None,
    *,
    global_scale_enc: GlobalScale | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] -> (packed uint8 [..., K/2], scale float8_e4m3fn [..., K/16]).

    Bit-exact with vLLM ``ref_nvfp4_quant(x, gs_enc, 16)`` where gs_enc is ``global_scale_enc``
    or, given a decode scale, ``fp32(1.0 / global_scale_dec)`` (what vLLM computes from a
    ModelOpt ``input_scale``). Blocks whose scale underflows to 0 (amax * gs_enc / 6 < 2^-10) get
    scale byte 0 and magnitude-0 codes (negative elements keep the sign bit, as -0.0 does in
    vLLM's float output).
    """
    codes, scale = quantize_codes(x, global_scale_dec, global_scale_enc=global_scale_enc)
    return pack_nibbles(codes), scale


def _check_packed_pair(packed: torch.Tensor, scale: torch.Tensor) -> None:
    check_dtype(packed, "packed", torch.uint8)
    check_dtype(scale, "scale", torch.float8_e4m3fn, torch.uint8)
    k = packed.shape[-1] * 2 if packed.ndim else 0
    expected = (*packed.shape[:-1], k // BLOCK)
    if packed.ndim == 0 or k % BLOCK != 0 or tuple(scale.shape) != expected:
        raise ValueError(
            f"packed has shape {tuple(packed.shape)} and scale {tuple(scale.shape)}; expected "
            f"packed [..., K/2] with K a multiple of {BLOCK} and scale [..., K/{BLOCK}]"
        )


def dequantize(
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale_dec: GlobalScale = 1.0,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[..., K/2] packed + [..., K/16] e4m3 scale -> [..., K] in ``dtype``.

    Computes RNE_dtype(e2m1 * (fp32(s) * gs_dec)), the order of vLLM ``dequantize_to_dtype``
    (swizzle=False) and its Triton kernel. Note this is *not* how Marlin/Humming serve the weight
    on Hopper (they apply gs to the fp32 accumulator, see ``quant.forms``); with gs_dec = 1 the
    result e2m1 * s is exact in bf16.
    """
    _check_packed_pair(packed, scale)
    s = scale.view(torch.float8_e4m3fn).to(torch.float32)
    gs = _global_scale(global_scale_dec, packed.shape[:-1], packed.device, "global_scale_dec")
    vals = unpack_values(packed).reshape(*s.shape, BLOCK)
    out = vals * (s * gs).unsqueeze(-1)
    return out.reshape(*packed.shape[:-1], packed.shape[-1] * 2).to(dtype)


def qdq_activation(x: torch.Tensor, global_scale_enc: GlobalScale) -> torch.Tensor:
    """NVFP4 quantize-dequantize of an activation with a static encode global scale, in x.dtype.

    Bit-exact with the CPU path of vLLM ``ref_nvfp4_quant_dequant`` (used by the emulation MoE):
    RNE_dtype(e2m1 * fp32(s / gs_enc)). Differentiable only through ``quant.forms`` (STE).
    """
    check_last_dim(x, "x", BLOCK)
    gs_enc = _global_scale(global_scale_enc, x.shape[:-1], x.device, "global_scale_enc")
    codes, scale = _quantize_blocks(x, gs_enc)
    out = e2m1_values(codes) * (scale / gs_enc).unsqueeze(-1)
    return out.reshape(x.shape).to(x.dtype)


def swizzle_scales(scale: torch.Tensor) -> torch.Tensor:
    """Row-major [..., M, K/16] block scales -> 128x4 layout [..., round_up(M,128),
    round_up(K/16,4)] as used by CUTLASS/FlashInfer on Blackwell; padding is zero."""
    return swizzle_128x4(scale)


def unswizzle_scales(swizzled: torch.Tensor, m: int, k: int) -> torch.Tensor:
    """Inverse of ``swizzle_scales`` for M=m rows and K=k elements (K/16 scale columns); the
    argument order follows vLLM's ``convert_swizzled_to_linear(a, m, k, 16)``."""
    if k % BLOCK != 0:
        raise ValueError(f"k={k} must be a multiple of {BLOCK}")
    return unswizzle_128x4(swizzled, m, k // BLOCK)
