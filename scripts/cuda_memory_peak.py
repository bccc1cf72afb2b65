"""What is allocated at a CUDA step's peak, and which code allocated it.

torch's allocator history (`torch.cuda.memory._record_memory_history`) is replayed to the moment the most memory was
allocated; the blocks live then are summed by allocation site: the innermost Python frame in this repo's code, else
the innermost Python frame, else "(no Python frame)" (a block allocated from C++ alone, as a built-in op's backward
on autograd's thread). The summary is a few KB of JSON, so it comes back from the device tool where a full snapshot
(hundreds of MB) would not; a snapshot for https://pytorch.org/memory_viz can still be written with
`torch.cuda.memory._dump_snapshot`.

Used by scripts/train_step_m3.py --memory-peak 1 (one extra, untimed step recorded after the timed ones).
"""

from __future__ import annotations

GB = 1e9
OURS = ("/rl/", "/quant/", "/scripts/", "/m3/")  # path parts of this repo's code in frame filenames
NO_FRAME = "(no Python frame)"
MAX_ENTRIES = 500_000  # allocator events kept (a ring buffer): one M3 slice step makes ~10^4-10^5


def start() -> None:
    import torch

    # Python stacks of allocations only: with stacks captured at frees too (context="all", with stacks "all" or
    # "python"), torch 2.11 on Python 3.12 failed inside the checkpointed recompute of the M3 slice ("LoRALinear.forward
    # returned NULL without setting an exception", results/gpu/run113-114; run116 ran this form)
    torch.cuda.memory._record_memory_history("all", context="alloc", stacks="python", max_entries=MAX_ENTRIES)


def stop_and_summarize(top: int = 20) -> dict:
    import torch

    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(None)
    return live_at_peak(snapshot["device_traces"][torch.cuda.current_device()], top)


def site(frames: list[dict]) -> str:
    """The allocation site of one block, from its Python frames (innermost first)."""
    for f in frames:
        if any(part in f.get("filename", "") for part in OURS):
            path = f["filename"]
            path = path[max(path.rfind(part) for part in OURS if part in path) + 1:]
            return f"{path}:{f.get('line', 0)} {f.get('name', '?')}"
    return f"{frames[0].get('filename', '?')}:{frames[0].get('line', 0)} {frames[0].get('name', '?')}" if frames \
        else NO_FRAME


def live_at_peak(trace: list[dict], top: int = 20) -> dict:
    """Replay alloc / free events: the peak of the bytes allocated since the trace began (blocks from before it are
    not in the trace: the resident weights are left out by construction) and the blocks live at that moment, summed
    by site (largest first, `top` of them) and by tensor size."""
    def replay(stop: int | None):
        live, total, peak, peak_at = {}, 0, 0, -1
        for i, e in enumerate(trace[:stop]):
            if e["action"] == "alloc":
                live[e["addr"]] = e
                total += e["size"]
                if total > peak:
                    peak, peak_at = total, i
            elif e["action"] in ("free_requested", "free_completed") and e["addr"] in live:
                total -= live.pop(e["addr"])["size"]
        return live, peak, peak_at

    _, peak, peak_at = replay(None)
    live, _, _ = replay(peak_at + 1)
    by_site, count = {}, {}
    for e in live.values():
        name = site(e.get("frames", []))
        by_site[name] = by_site.get(name, 0) + e["size"]
        count[name] = count.get(name, 0) + 1
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1])
    sizes = {}
    for e in live.values():
        sizes[e["size"]] = sizes.get(e["size"], 0) + 1
    return {
        "peak_since_trace_start_gb": round(peak / GB, 3),
        "events": len(trace), "peak_event": peak_at, "trace_may_be_truncated": len(trace) >= MAX_ENTRIES,
        "live_blocks_at_peak": len(live),
        "live_at_peak_by_site_gb": {k: round(v / GB, 3) for k, v in ranked[:top]},
        "blocks_by_site": {k: count[k] for k, _ in ranked[:top]},
        "other_sites_gb": round(sum(v for _, v in ranked[top:]) / GB, 3),
        "largest_block_sizes_gb": {f"{s / GB:.3f}": n for s, n in sorted(sizes.items(), reverse=True)[:10]},
    }
