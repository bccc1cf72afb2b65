"""Where a GPU waits: the idle gaps between the kernels of a torch.profiler capture.

Kernels on several streams overlap; the GPU counts as busy while any kernel runs, so a gap is time no kernel covers.
Each gap is named by the kernel that ended last before it and the one that starts it; many small gaps between the
same two kernels (a launch-bound loop) add up under their pair, which is how a step's idle time is found when no
single gap is large.

Used by scripts/bench_msa.py (--profile) and scripts/train_step_m3.py (--profile 1).
"""

from __future__ import annotations

import collections


def kernel_spans(events) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of the device events of a torch.profiler capture (`prof.events()`), by start."""
    import torch

    return sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)


def idle_gaps(spans, top: int = 8, name_chars: int = 60) -> dict:
    """From (start, end, name) spans sorted by start: the span from the first start to the last end, the time no
    span covers inside it, the `top` largest gaps and the `top` (after, before) kernel pairs with the most idle time
    between them (times in us)."""
    if not spans:
        return {"span_us": 0.0, "idle_us": 0.0, "gaps": 0, "largest_gaps": [], "idle_by_neighbours": []}
    gaps, end, before = [], spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((start - end, before[:name_chars], name[:name_chars]))
        if stop >= end:
            end, before = stop, name
    pairs = collections.defaultdict(lambda: [0.0, 0])
    for us, after, nxt in gaps:
        pairs[(after, nxt)][0] += us
        pairs[(after, nxt)][1] += 1
    return {"span_us": end - spans[0][0], "idle_us": sum(g[0] for g in gaps), "gaps": len(gaps),
            "largest_gaps": [{"us": us, "after": a, "before": b} for us, a, b in sorted(gaps, key=lambda g: -g[0])[:top]],
            "idle_by_neighbours": [{"us": us, "gaps": n, "after": a, "before": b}
                                   for (a, b), (us, n) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]]}
