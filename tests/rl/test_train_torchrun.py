"""rl.train under torchrun with 2 CPU processes (gloo): FSDP2-sharded LoRA and base (actor.fsdp_config.shard_base),
one engine per rank serving its share of the prompts, and after every step both ranks' engines hold byte-identical
adapters (same checksum)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

from m3.tiny import ensure_tiny_model
from tests.rl.test_train import fast_overrides

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_process_run_keeps_identical_adapters_on_both_ranks(tmp_path):
    model_dir = ensure_tiny_model(dtype="float32").vllm
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), "-m", "rl.train",
           *fast_overrides(tmp_path / "run", model_dir), "data.train_batch_size=4",
           "actor.fsdp_config.shard_base=true"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert len(r["sync/rank_checksums"]) == 2 and len(set(r["sync/rank_checksums"])) == 1
        assert r["sync/checksum"] == r["sync/rank_checksums"][0]
