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

import torch

__all__ = ["grouped_mm", "grouped_mm_t", "torch_grouped_mm_ok"]


@functools.lru_cache(maxsize=None)
def _cuda_sm90(index: int) -> bool:
    return torch.cuda.get_device_capability(index) >= (9, 0)


def torch_grouped_mm_ok(*tensors: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm``'s fast path takes these operands (bf16 on an sm90+ GPU)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    t = tensors[0]
    return (t.is_cuda and all(x.dtype == torch.bfloat16 for x in tensors)
            and _cuda_sm90(t.device.index if t.device.index is not None else torch.cuda.current_device()))


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
