"""scripts/gpu_idle.py: the idle time between kernels of a profiler capture, with kernels on two streams overlapping."""

import sys
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

import gpu_idle  # noqa: E402


def test_idle_gaps_count_only_time_no_kernel_covers():
    spans = [
        (0, 100, "gemm"),
        (40, 300, "decode"),  # a side stream: overlaps gemm, ends after it
        (320, 400, "gemm"),  # 20 us idle after decode (the kernel that ended last), not after gemm
        (350, 380, "small"),  # inside the previous kernel: no gap, and it is not the last to end
        (410, 420, "small"),  # 10 us after gemm
        (425, 430, "gemm"),  # 5 us after small
        (440, 450, "gemm"),  # 10 us after gemm
        (455, 460, "small"),  # 5 us after gemm
        (470, 480, "small"),  # 10 us after small
    ]
    r = gpu_idle.idle_gaps(spans, top=3)
    assert r["span_us"] == 480
    assert r["idle_us"] == 20 + 10 + 5 + 10 + 5 + 10
    assert r["gaps"] == 6
    assert r["largest_gaps"][0] == {"us": 20, "after": "decode", "before": "gemm"}
    assert [g["us"] for g in r["largest_gaps"]] == [20, 10, 10]
    by_pair = {(g["after"], g["before"]): (g["us"], g["gaps"]) for g in r["idle_by_neighbours"]}
    assert by_pair[("decode", "gemm")] == (20, 1)
    assert by_pair[("gemm", "small")] == (15, 2)  # two small gaps add up under their pair
    assert len(r["idle_by_neighbours"]) == 3  # top 3 of the 5 pairs
    assert gpu_idle.idle_gaps([])["idle_us"] == 0.0


def _event(name, start, end, device="CPU", thread=1, annotation=False, parent=None):
    import torch

    e = SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), thread=thread,
                        device_type=getattr(torch.autograd.DeviceType, device), is_user_annotation=annotation,
                        cpu_parent=parent, cpu_children=[])
    if parent is not None:
        parent.cpu_children.append(e)
    return e


def test_kernel_spans_leave_out_annotation_ranges():
    # a record_function label's GPU-side range spans its kernels and the gap between them: not busy time
    events = [_event("gemm", 0, 10, "CUDA"), _event("m3/expert", 0, 50, "CUDA", annotation=True),
              _event("gemm", 40, 50, "CUDA")]
    spans = gpu_idle.kernel_spans(events)
    assert [s[2] for s in spans] == ["gemm", "gemm"]
    assert gpu_idle.idle_gaps(spans)["idle_us"] == 30
    assert gpu_idle.gap_list(spans) == [(10, 40, "gemm", "gemm")]


def test_host_during_gaps_names_the_innermost_op_and_its_label():
    # main thread: m3/expert { addmm_ [0, 5], python between ops, item [20, 60] { sync [21, 59] } };
    # the autograd thread: a backward node { mm [100, 130] }
    label = _event("m3/expert", 0, 70)
    _event("aten::addmm_", 0, 5, parent=label)
    item = _event("aten::item", 20, 60, parent=label)
    _event("cudaStreamSynchronize", 21, 59, parent=item)
    node = _event("autograd::engine::evaluate_function: MmBackward0", 90, 140, thread=2)
    _event("aten::mm", 100, 130, thread=2, parent=node)
    events = [label, *label.cpu_children, *item.cpu_children, node, *node.cpu_children]
    gaps = [(6, 14, "k", "k"), (30, 50, "k", "k"), (110, 120, "k", "k"), (200, 204, "k", "k")]
    r = gpu_idle.host_during_gaps(gaps, events)
    assert r["idle_us"] == 8 + 20 + 10 + 4 and r["gaps"] == 4
    ctx = {row["context"]: (row["us"], row["gaps"]) for row in r["by_context"]}
    assert ctx == {"m3/expert": (28, 2), "MmBackward0": (10, 1), "(no op)": (4, 1)}
    ops = {(row["context"], row["op"], row["parent"]): row["us"] for row in r["by_op"]}
    assert ops[("m3/expert", "m3/expert", "")] == 8  # Python between ops: under the label that encloses it
    assert ops[("m3/expert", "cudaStreamSynchronize", "aten::item")] == 20
    assert ops[("MmBackward0", "aten::mm", "autograd::engine::evaluate_function: MmBackward0")] == 10
