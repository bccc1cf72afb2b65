"""The embedded default learns: `python -m rl.train` with no model/data arguments warms up the tiny M3, quantizes it,
passes rl.check, and GRPO raises the training reward and the eval pass@1 of the sampled policy.

- In `make test`: the same run cut to 40 steps (seed 0: reward first-5 -> last-5 0.556 -> 0.703, sampled eval pass@1
  0.500 -> 0.639, 4 min 28 s from an empty cache; results/make_train_cpu.json "make_test_variant"). Over seeds 0-2 the reward gain at step 40 was
  +0.147 / +0.233 / +0.176; noise: the per-step reward s.d. is ~0.09, so a gain of 5-step means has s.d. ~0.057 when
  nothing is learned, and the sampled eval (200 problems x 4 samples) has a paired-difference s.d. of ~0.02. The
  asserted +0.08 eval gain is 4 s.d. of that noise. make test now runs it on 1 thread beside the other xdist
  worker (7 min 46 s; results/test_learns_one_thread.json): reward gain +0.172 / +0.219 / +0.167 and eval gain
  +0.265 / +0.253 / +0.249 on seeds 0-2; with actor.optim.lr=1e-12 (no learning) +0.022 / -0.023 and 0.000: fails.
- `slow`: the full default run at issue 12's margins."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_default(run, *overrides) -> tuple[dict, float, float]:
    """(summary, mean reward of the first 5 steps, of the last 5) of `python -m rl.train` with the overrides."""
    # Alone, the RL phase on both cores (measured: the same metrics as on 1 thread, 4 min 28 s instead of 5 min 37 s);
    # beside another xdist worker (make test), tests/conftest.py has set M3RL_TORCH_THREADS=1 and OMP_NUM_THREADS=1
    env = dict(os.environ, PYTHONPATH=str(ROOT), M3RL_TORCH_THREADS=os.environ.get("M3RL_TORCH_THREADS", "2"))
    subprocess.run([sys.executable, "-m", "rl.train", f"trainer.run_dir={run}", "logger.wandb_mode=disabled",
                    *overrides], cwd=ROOT, env=env, check=True, timeout=3600)
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["check_step0"]["passed"]
    return summary, sum(r["reward/mean"] for r in rows[:5]) / 5, sum(r["reward/mean"] for r in rows[-5:]) / 5


def test_embedded_default_learns_in_40_steps(tmp_path):
    summary, first, last = run_default(tmp_path / "run", "trainer.total_training_steps=40", "trainer.save_freq=40")
    assert last >= first + 0.07, (first, last)
    assert summary["eval_after"]["pass@1"] >= summary["eval_before"]["pass@1"] + 0.08, summary


@pytest.mark.slow
def test_embedded_default_reward_goes_up(tmp_path):
    summary, first, last = run_default(tmp_path / "run")
    assert last >= first + 0.10, (first, last)
    assert summary["eval_after"]["pass@1"] >= summary["eval_before"]["pass@1"] + 0.15, summary
