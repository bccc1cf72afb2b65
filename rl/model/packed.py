"""Packed batches without padding: `cu_seqlens [B+1]` offsets into one token axis, positions restarting per
sequence (left padding would shift MSA blocks). Shared by the model and the MSA kernels."""

from __future__ import annotations

from typing import Sequence

import torch


def seq_bounds(cu_seqlens: torch.Tensor | Sequence[int]) -> list[tuple[int, int]]:
    """[(start, end)] per sequence, after checking that cu_seqlens is a non-decreasing offset list from 0."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else [int(c) for c in cu_seqlens]
    if len(cu) < 2 or cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"cu_seqlens must be non-decreasing offsets starting at 0 with >= 2 entries, got {cu}")
    return list(zip(cu[:-1], cu[1:]))


def host_offsets(cu_seqlens: torch.Tensor | Sequence[int]) -> list[int]:
    """cu_seqlens as a host list (one device->host copy for a CUDA tensor): the form to hand to every layer, whose
    MSA calls would otherwise each read a device tensor back (a host sync per call)."""
    return [0] + [e for _, e in seq_bounds(cu_seqlens)]


def to_device(values: Sequence[int], device, dtype=torch.int64) -> torch.Tensor:
    """A small host list on `device` without a host sync: to CUDA through pinned memory, non-blocking (a copy from
    pageable memory waits until the stream has run everything queued before it)."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def token_positions(cu_seqlens, device=None) -> torch.Tensor:
    """Position of every packed token inside its own sequence (int64 [T])."""
    bounds = seq_bounds(cu_seqlens)
    total = bounds[-1][1]
    device = device or "cpu"
    lens, starts = to_device([e - s for s, e in bounds] + [s for s, _ in bounds], device).split(len(bounds))
    return torch.arange(total, device=device) - starts.repeat_interleave(lens, output_size=total)


def sequence_groups(bounds: list[tuple[int, int]], max_tokens: int) -> list[tuple[int, int]]:
    """Token ranges [start, end) of consecutive sequences with at most max_tokens tokens each (0: one range); a longer
    sequence is a range of its own."""
    groups = []
    for s, e in bounds:
        if groups and e == s:  # an empty sequence: nothing to run (it ends where the last group ends)
            continue
        if groups and max_tokens and e - groups[-1][0] > max_tokens:
            groups.append((s, e))
        elif groups:
            groups[-1] = (groups[-1][0], e)
        else:
            groups.append((s, e))
    return groups


def sequence_group_spans(bounds: list[tuple[int, int]], max_tokens: int) -> list[tuple[int, int, list[int]]]:
    """sequence_groups with each group's own cu_seqlens (its sequences' ends, from the group's start)."""
    return [(s, e, [0] + [end - s for _, end in bounds if s < end <= e])
            for s, e in sequence_groups(bounds, max_tokens)]
