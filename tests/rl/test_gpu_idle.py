"""scripts/gpu_idle.py: the idle time between kernels of a profiler capture, with kernels on two streams overlapping."""

import sys
from pathlib import Path

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
