"""Shared pieces of the NVFP4 / MXFP8 codecs: E2M1 rounding, a version-proof E4M3 cast, the 128x4
scale swizzle and input checks.

Pure torch on purpose: this package runs inside the trainer, where vLLM is not installed.
"""

from __future__ import annotations

import torch

E4M3_MAX = 448.0
E2M1_MAX = 6.0

# Magnitudes of E2M1 codes 0..7; codes 8..15 are the same with the sign bit (bit 3) set.
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def check_last_dim(t: torch.Tensor, name: str, multiple: int) -> None:
    if t.ndim == 0 or t.shape[-1] % multiple != 0 or t.shape[-1] == 0:
        raise ValueError(
            f"{name} has shape {tuple(t.shape)}; its last dimension must be a positive multiple "
            f"of {multiple}"
        )


def check_dtype(t: torch.Tensor, name: str, *dtypes: torch.dtype) -> None:
    if t.dtype not in dtypes:
        names = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} has dtype {t.dtype} (shape {tuple(t.shape)}); expected {names}")


def to_e4m3(x: torch.Tensor) -> torch.Tensor:
    """RNE cast of fp32 to float8_e4m3fn that saturates finite and infinite values at +-448.

    torch 2.11 turns anything >= 464 (and +-inf) into NaN while torch 2.13 saturates, so the clamp
    is what makes the result independent of the torch version. NaN stays NaN; a NaN with its sign
    bit set is made positive so the byte is always 0x7F.
    """
    x = torch.where(torch.isnan(x), x.abs(), x)
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8 0..15) of fp32 values already clamped to [-6, 6].

    Round-to-nearest-even on the E2M1 grid: a tie goes to the neighbour with the even code, which
    gives the half-open intervals below (0.25->0, 0.75->1.0, 1.25->1.0, 1.75->2, 2.5->2, 3.5->4,
    5->4). These are the thresholds of vLLM's ``cast_to_fp4``. The sign bit is set for v < 0 only,
    so -0.0 gives code 0, as vLLM's ``x * torch.sign(x)`` does; a negative value that rounds to
    zero keeps its sign (code 8, -0.0), again like vLLM's float output. NaN gives code 0: callers
    that need NaN handle it through the block scale.
    """
    a = v.abs()
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75).to(torch.uint8)
        + (a > 1.25).to(torch.uint8)
        + (a >= 1.75).to(torch.uint8)
        + (a > 2.5).to(torch.uint8)
        + (a >= 3.5).to(torch.uint8)
        + (a > 5.0).to(torch.uint8)
    )
    return mag | ((v < 0).to(torch.uint8) << 3)


def e2m1_table(device: torch.device | str | None = None) -> torch.Tensor:
    """fp32 value of each of the 16 codes; code 8 is -0.0."""
    mags = torch.tensor(E2M1_MAGNITUDES, dtype=torch.float32, device=device)
    return torch.cat([mags, -mags])


def e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 E2M1 codes (only the low 4 bits are read)."""
    return e2m1_table(codes.device)[(codes & 0x0F).long()]


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[..., K] codes -> [..., K/2] bytes, the even element in the low nibble (vLLM, ModelOpt,
    flashinfer and torchao all agree on this order)."""
    check_last_dim(codes, "codes", 2)
    c = codes.to(torch.uint8) & 0x0F
    return c[..., 0::2] | (c[..., 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes -> [..., K] codes (inverse of ``pack_nibbles``)."""
    check_dtype(packed, "packed", torch.uint8)
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def swizzle_128x4(scale: torch.Tensor) -> torch.Tensor:
    """Row-major block scales [..., M, C] -> the cuBLAS/CUTLASS "128x4" layout, shape
    [..., round_up(M, 128), round_up(C, 4)] (the shape vLLM's ``swizzle_blockscale`` returns).

    The flat order of each trailing matrix is the layout: element (r, c) sits at
    ((r // 128) * ceil(C / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4.
    Padding is zero, which the kernels read as "scale 0".
    """
    if scale.ndim < 2:
        raise ValueError(f"scale has shape {tuple(scale.shape)}; expected [..., M, C]")
    *lead, m, c = scale.shape
    mp, cp = _round_up(m, 128), _round_up(c, 4)
    raw = scale.view(torch.uint8) if scale.element_size() == 1 else scale
    padded = raw.new_zeros(*lead, mp, cp)
    padded[..., :m, :c] = raw
    # row r = 128*i + 32*j + k (j = (r%128)//32, k = r%32), column c = 4*t + u
    tiles = padded.reshape(*lead, mp // 128, 4, 32, cp // 4, 4)
    n = len(lead)
    perm = list(range(n)) + [n, n + 3, n + 2, n + 1, n + 4]  # -> [i, t, k, j, u]
    out = tiles.permute(*perm).reshape(*lead, mp, cp).contiguous()
    return out.view(scale.dtype) if raw is not scale else out


def unswizzle_128x4(swizzled: torch.Tensor, m: int, c: int) -> torch.Tensor:
    """Inverse of ``swizzle_128x4``: any tensor holding [..., round_up(m,128) * round_up(c,4)]
    elements in the 128x4 layout (2-D padded shape or flat) -> row-major [..., m, c]."""
    mp, cp = _round_up(m, 128), _round_up(c, 4)
    per = mp * cp
    if swizzled.numel() % per != 0 or swizzled.numel() == 0:
        raise ValueError(
            f"swizzled scale has shape {tuple(swizzled.shape)}; expected a multiple of "
            f"{mp}*{cp}={per} elements for m={m}, c={c}"
        )
    raw = swizzled.view(torch.uint8) if swizzled.element_size() == 1 else swizzled
    if swizzled.ndim >= 2 and swizzled.shape[-2:] == (mp, cp):
        lead = list(swizzled.shape[:-2])
    else:
        lead = [swizzled.numel() // per] if swizzled.numel() != per else []
    tiles = raw.reshape(*lead, mp // 128, cp // 4, 32, 4, 4)  # [i, t, k, j, u]
    n = len(lead)
    perm = list(range(n)) + [n, n + 3, n + 2, n + 1, n + 4]  # -> [i, j, k, t, u]
    out = tiles.permute(*perm).reshape(*lead, mp, cp)[..., :m, :c].contiguous()
    return out.view(swizzled.dtype) if raw is not swizzled else out
