"""Where a GPU waits: the idle gaps between the kernels of a torch.profiler capture.

Kernels on several streams overlap; the GPU counts as busy while any kernel runs, so a gap is time no kernel covers.
Each gap is named by the kernel that ended last before it and the one that starts it; many small gaps between the
same two kernels (a launch-bound loop) add up under their pair, which is how a step's idle time is found when no
single gap is large. `host_during_gaps` names what the host was doing meanwhile (the op it was in, under which
label or backward node): a GPU that waits for its host shows there.

Used by scripts/bench_msa.py (--profile) and scripts/train_step_m3.py (--profile 1).
"""

from __future__ import annotations

import bisect
import collections


def kernel_spans(events) -> list[tuple[float, float, str]]:
    """(start us, end us, name) of the device events of a torch.profiler capture (`prof.events()`), by start:
    kernels, copies and memsets. Not the GPU-side ranges of `record_function` labels (user annotations): they span
    their kernels and the idle time between them, which would then count as busy."""
    import torch

    return sorted((e.time_range.start, e.time_range.end, e.name) for e in events
                  if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
                  and not getattr(e, "is_user_annotation", False))


def gap_list(spans) -> list[tuple[float, float, str, str]]:
    """From (start, end, name) spans sorted by start: each stretch no span covers, as (start, end, name of the span
    that ended last before it, name of the span that starts it)."""
    gaps = []
    if not spans:
        return gaps
    end, before = spans[0][1], spans[0][2]
    for start, stop, name in spans[1:]:
        if start > end:
            gaps.append((end, start, before, name))
        if stop >= end:
            end, before = stop, name
    return gaps


def idle_gaps(spans, top: int = 8, name_chars: int = 60) -> dict:
    """From (start, end, name) spans sorted by start: the span from the first start to the last end, the time no
    span covers inside it, the `top` largest gaps and the `top` (after, before) kernel pairs with the most idle time
    between them (times in us)."""
    if not spans:
        return {"span_us": 0.0, "idle_us": 0.0, "gaps": 0, "largest_gaps": [], "idle_by_neighbours": []}
    gaps = [(b - a, after[:name_chars], nxt[:name_chars]) for a, b, after, nxt in gap_list(spans)]
    pairs = collections.defaultdict(lambda: [0.0, 0])
    for us, after, nxt in gaps:
        pairs[(after, nxt)][0] += us
        pairs[(after, nxt)][1] += 1
    end = max(s[1] for s in spans)
    return {"span_us": end - spans[0][0], "idle_us": sum(g[0] for g in gaps), "gaps": len(gaps),
            "largest_gaps": [{"us": us, "after": a, "before": b}
                             for us, a, b in sorted(gaps, key=lambda g: -g[0])[:top]],
            "idle_by_neighbours": [{"us": us, "gaps": n, "after": a, "before": b}
                                   for (a, b), (us, n) in sorted(pairs.items(), key=lambda kv: -kv[1][0])[:top]]}


def _innermost(level, t, kids):
    """The deepest node holding time t, from `level` = (nodes sorted by start, their starts) and kids(node), the
    same for a node's children (properly nested ranges)."""
    found = None
    while level[0]:
        nodes, starts = level
        i = bisect.bisect_right(starts, t) - 1
        if i < 0 or nodes[i].time_range.end < t:
            break
        found = nodes[i]
        level = kids(found)
    return found


def host_during_gaps(gaps, events, top: int = 12, name_chars: int = 60) -> dict:
    """What the host was doing while the GPU idled: for each gap of `gap_list`, the innermost CPU op (any thread; the
    latest-started where threads differ) whose time range holds the gap's middle, with its parent and its context,
    the innermost enclosing `m3/` label or autograd node (backward). Idle time summed by context and by (context,
    op, parent), the `top` of each (times in us). Python code between ops counts under the op that encloses it."""
    import torch

    cpu = [e for e in events
           if e.device_type == torch.autograd.DeviceType.CPU and e.time_range.end > e.time_range.start]
    by_thread = collections.defaultdict(list)
    for e in cpu:
        if e.cpu_parent is None:
            by_thread[e.thread].append(e)

    def level(nodes):
        nodes = sorted(nodes, key=lambda e: e.time_range.start)
        return nodes, [e.time_range.start for e in nodes]

    roots, cache = [level(v) for v in by_thread.values()], {}

    def kids(e):
        if id(e) not in cache:
            cache[id(e)] = level(e.cpu_children)
        return cache[id(e)]

    def context(e):
        while e is not None:
            if e.name.startswith("m3/") or e.name.startswith("autograd::engine::evaluate_function"):
                return e.name.removeprefix("autograd::engine::evaluate_function: ")[:name_chars]
            e = e.cpu_parent
        return "(none)"

    by_ctx, by_op = collections.defaultdict(lambda: [0.0, 0]), collections.defaultdict(lambda: [0.0, 0])
    for a, b, _, _ in gaps:
        inner = [x for x in (_innermost(r, (a + b) / 2, kids) for r in roots) if x is not None]
        e = max(inner, key=lambda x: x.time_range.start) if inner else None
        ctx = context(e) if e is not None else "(no op)"
        op = e.name[:name_chars] if e is not None else "(no op)"
        parent = e.cpu_parent.name[:name_chars] if e is not None and e.cpu_parent is not None else ""
        for table, key in ((by_ctx, ctx), (by_op, (ctx, op, parent))):
            table[key][0] += b - a
            table[key][1] += 1
    return {"idle_us": sum(b - a for a, b, _, _ in gaps), "gaps": len(gaps),
            "by_context": [{"context": k, "us": round(us, 1), "gaps": n}
                           for k, (us, n) in sorted(by_ctx.items(), key=lambda kv: -kv[1][0])[:top]],
            "by_op": [{"context": c, "op": o, "parent": p, "us": round(us, 1), "gaps": n}
                      for (c, o, p), (us, n) in sorted(by_op.items(), key=lambda kv: -kv[1][0])[:top]]}
