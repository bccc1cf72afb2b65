"""Grouped GEMMs over expert-sorted rows: the rows of group g are ``offsets[g]:offsets[g+1]`` of a 2-D operand
(``offsets`` [G+1] int32, as ``sort_by_expert`` builds them). Two shapes:

- ``grouped_mm(a, b, offsets)``: a [M, K], b [G, K, N] -> [M, N], row block g times b[g] (forward / input grad);
- ``grouped_mm_t(a, b, offsets)``: a [M, P], b [M, Q] -> [G, P, Q], a_g^T @ b_g (weight gradients; the groups
  split the reduction, so an empty group gives zeros).

bf16 on an sm90+ GPU: ``torch._grouped_mm`` (CUTLASS, fp32 accumulation, one rounding to bf16), no host sync.
Anything else (CPU, fp32, older GPUs): a loop over the groups with an fp32 product of the same operands, rounded
once to the operands' dtype (the offsets are read on the host). ``impl`` forces either ("torch" / "loop").
"""

import functools
import warnings

import torch

__all__ = ["grouped_mm", "grouped_mm_t", "torch_grouped_mm_ok"]


@functools.lru_cache(maxsize=None)
def _cuda_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


@functools.lru_cache(maxsize=None)
def _probe(index: int) -> bool:
    """Both call forms of torch._grouped_mm agree with the loop on this GPU (uneven and empty groups included);
    a torch whose kernel refuses or miscomputes them makes the callers take the loop instead of failing."""
    dev = torch.device("cuda", index)
    g = torch.Generator(device=dev).manual_seed(0)
    offsets = torch.tensor([0, 3, 3, 40, 41, 72], dtype=torch.int32, device=dev)
    a = torch.randn(72, 64, device=dev, generator=g).bfloat16()
    b = torch.randn(5, 32, 64, device=dev, generator=g).bfloat16()
    c = torch.randn(72, 48, device=dev, generator=g).bfloat16()
    try:
        bt = b.transpose(1, 2)
        pairs = [(grouped_mm(a, bt, offsets, "torch"), grouped_mm(a, bt, offsets, "loop")),
                 (grouped_mm_t(a, c, offsets, "torch"), grouped_mm_t(a, c, offsets, "loop"))]
        ok = all(bool(((x.float() - y.float()).norm() <= 1e-2 * y.float().norm()).item()) for x, y in pairs)
    except (RuntimeError, NotImplementedError, TypeError) as exc:
        warnings.warn(f"torch._grouped_mm unusable here ({exc}); grouped GEMMs loop over groups", stacklevel=2)
        return False
    if not ok:
        warnings.warn("torch._grouped_mm disagrees with the loop here; grouped GEMMs loop over groups", stacklevel=2)
    return ok


def torch_grouped_mm_ok(*tensors: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm``'s fast path takes these operands (bf16 on an sm90+ GPU where it checks out)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    t = tensors[0]
    if not (t.is_cuda and all(x.dtype == torch.bfloat16 for x in tensors)):
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _cuda_sm90(index) and _probe(index)


def _use_torch(impl: str, *tensors) -> bool:
    if impl not in ("auto", "torch", "loop"):
        raise ValueError(f"impl={impl!r}: expected 'auto', 'torch' or 'loop'")
    return impl == "torch" or (impl == "auto" and torch_grouped_mm_ok(*tensors))


def _ends(offsets: torch.Tensor) -> torch.Tensor:
    return offsets[1:].to(torch.int32)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """a [M, K] (rows grouped by ``offsets``), b [G, K, N] -> [M, N] in a's dtype."""
    if b.ndim != 3 or a.ndim != 2 or a.shape[1] != b.shape[1] or offsets.numel() != b.shape[0] + 1:
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)}, offsets {offsets.numel()}: expected [M, K], "
                         f"[G, K, N], G+1")
    if _use_torch(impl, a, b):
        return torch._grouped_mm(a, b, offs=_ends(offsets))
    bounds = offsets.tolist()
    out = a.new_zeros(a.shape[0], b.shape[2])
    for g in range(b.shape[0]):
        lo, hi = bounds[g], bounds[g + 1]
        if hi > lo:
            out[lo:hi] = (a[lo:hi].float() @ b[g].float()).to(a.dtype)
    return out


def grouped_mm_t(a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """a [M, P], b [M, Q] (rows grouped by ``offsets``) -> [G, P, Q] = a_g^T @ b_g in a's dtype."""
    if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[0]:
        raise ValueError(f"a {tuple(a.shape)}, b {tuple(b.shape)}: expected [M, P] and [M, Q]")
    groups = offsets.numel() - 1
    if _use_torch(impl, a, b):
        out = torch._grouped_mm(a.t(), b, offs=_ends(offsets))
        # Empty groups: no rows to reduce over; zero them rather than trust what the kernel leaves there.
        empty = (offsets[1:] == offsets[:-1]).to(out.device)
        return out.masked_fill(empty[:, None, None], 0)
    bounds = offsets.tolist()
    out = a.new_zeros(groups, a.shape[1], b.shape[1])
    for g in range(groups):
        lo, hi = bounds[g], bounds[g + 1]
        if hi > lo:
            out[g] = (a[lo:hi].float().t() @ b[lo:hi].float()).to(a.dtype)
    return out
