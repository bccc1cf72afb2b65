"""The DAPO-Math / AIME-2024 recipe at CPU scale (recipes/dapo_math_tiny_cpu.yaml: the recipe's algorithm and data
keys, the tiny M3 quantized as served, NVFP4 KV cache) end to end through `python -m rl.train`, on locally written
files in the public layouts: DAPO-Math-17K's parquet columns for training, each AIME-2024 layout rl.data reads for
eval; reward through verl's math_dapo; eval avg@k, pass@k and unbiased pass@j. A random tiny model never writes a
correct "Answer:" line, so the reward is math_dapo's -1 throughout: this run checks the path, not learning
(tests/rl/test_train_learns.py does that on the built-in task)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rollout.engine_fixtures import quantized_tiny_model

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.parametrize("val_layout,steps", [("lower", 4), ("verl", 1), ("pascal", 1)])
def test_cpu_recipe_runs_end_to_end(math_data, tmp_path, val_layout, steps):
    run_dir = tmp_path / "run"
    p = subprocess.run([sys.executable, "-m", "rl.train", "--config-path", "../recipes", "--config-name",
                        "dapo_math_tiny_cpu", f"model.path={quantized_tiny_model('float32')}",
                        f"data.train_files={math_data}/dapo-math-17k.parquet",
                        f"data.val_files={math_data}/aime-2024-{val_layout}.parquet", f"trainer.run_dir={run_dir}",
                        f"trainer.total_training_steps={steps}", f"trainer.save_freq={steps}"],
                       cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["check_step0"]["passed"] and summary["steps"] == steps and summary["nonfinite_steps"] == 0
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps and all(r["reward/mean"] == -1.0 for r in rows)  # math_dapo's scale: -1 when wrong
    assert all(r["agreement/routing"] == 1.0 and r["train_rollout/kl_k3"] < 1e-6 for r in rows)
    for key in ("eval_before", "eval_after"):
        assert set(summary[key]) >= {"pass@1", "pass@k", "pass@2_unbiased", "greedy_pass@1"} and summary[key]["k"] == 4
    assert (run_dir / "final_adapter" / "adapter_model.safetensors").is_file()
