"""The embedded default learns: `python -m rl.train` with no model/data arguments warms up the tiny M3, quantizes it,
passes rl.check, and GRPO raises the training reward and the eval pass@1 of the sampled policy.

- In `make test` (4 min 27 s from an empty cache, seed 0: reward 0.588 -> 0.733, sampled pass@1 0.571 -> 0.678):
  the same run cut to 40 steps. Measured over seeds 0-2
  (results/make_train_cpu.json): at step 40 the reward's first-5 -> last-5 gain was +0.145 / +0.148 / +0.159, with a
  per-step reward s.d. of ~0.09 (a gain of 5-step means has s.d. ~0.057 when nothing is learned); the sampled eval
  pass@1 (200 problems x 4 samples, s.d. of a paired difference ~0.02) gained +0.11 to +0.18 by step 70.
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
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "rl.train", f"trainer.run_dir={run}", "logger.wandb_mode=disabled",
                    *overrides], cwd=ROOT, env=env, check=True, timeout=3600)
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert summary["check_step0"]["passed"]
    return summary, sum(r["reward/mean"] for r in rows[:5]) / 5, sum(r["reward/mean"] for r in rows[-5:]) / 5


def test_embedded_default_learns_in_40_steps(tmp_path):
    summary, first, last = run_default(tmp_path / "run", "trainer.total_training_steps=40", "trainer.save_freq=40")
    assert last >= first + 0.07, (first, last)
    assert summary["eval_after"]["pass@1"] >= summary["eval_before"]["pass@1"] + 0.05, summary


@pytest.mark.slow
def test_embedded_default_reward_goes_up(tmp_path):
    summary, first, last = run_default(tmp_path / "run")
    assert last >= first + 0.10, (first, last)
    assert summary["eval_after"]["pass@1"] >= summary["eval_before"]["pass@1"] + 0.15, summary
