"""scripts/cuda_memory_peak.py on an allocator history in torch's snapshot format (what
torch.cuda.memory._snapshot()["device_traces"][device] holds): the peak, the blocks live at it, their sites."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import cuda_memory_peak as cmp  # noqa: E402

GB = 10**9
OURS = {"filename": "/work/main/rl/model/lean.py", "line": 40, "name": "forward"}
TORCH = {"filename": "/venv/torch/nn/functional.py", "line": 7, "name": "linear"}


def alloc(addr, gb, *frames):
    return {"action": "alloc", "addr": addr, "size": int(gb * GB), "frames": list(frames)}


def free(addr, action="free_requested"):
    return {"action": action, "addr": addr, "size": 0, "frames": []}


def test_blocks_live_at_the_peak_by_site():
    trace = [
        alloc(1, 2.0, TORCH, OURS),  # our code's frame wins over torch's inner one
        alloc(2, 1.0),  # from C++ alone (a built-in backward on autograd's thread)
        free(2), free(2, "free_completed"),  # freed once: the second event changes nothing
        alloc(3, 3.0, OURS),  # 5 GB live (blocks 1 and 3)
        free(1),
        alloc(4, 2.5, TORCH),  # the peak, 5.5 GB: blocks 3 and 4 (8 GB if block 1 still counted)
        {"action": "segment_alloc", "addr": 9, "size": 10 * GB, "frames": []},  # cudaMalloc, not a tensor
        free(99),  # allocated before the trace began: ignored
    ]
    r = cmp.live_at_peak(trace)
    assert r["peak_since_trace_start_gb"] == 5.5
    assert r["peak_event"] == 6 and r["live_blocks_at_peak"] == 2
    assert r["live_at_peak_by_site_gb"] == {"rl/model/lean.py:40 forward": 3.0,
                                           "/venv/torch/nn/functional.py:7 linear": 2.5}
    assert not r["trace_may_be_truncated"]


def test_sites():
    assert cmp.site([TORCH, OURS]) == "rl/model/lean.py:40 forward"
    assert cmp.site([TORCH]) == "/venv/torch/nn/functional.py:7 linear"
    assert cmp.site([]) == "(no Python frame)"
