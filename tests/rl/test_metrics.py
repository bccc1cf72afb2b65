"""The console shows one line per step (reward, acc, KL, step time); the full metrics go to metrics.jsonl."""

import json
from types import SimpleNamespace

from rl.metrics import MetricsLogger, console_line


def test_console_line_is_one_line_with_the_step_summary():
    m = {"reward/mean": 0.5, "reward/acc": 0.25, "train_rollout/kl_k3": 1.2e-12, "train/grad_norm": 0.1,
         "time/generate_s": 0.8, "time/step_s": 2.61, "is/ratio_max": 1.0, "eval/pass@1": 0.7}
    line = console_line(3, 70, m)
    assert "\n" not in line
    for part in ("step 3/70", "reward 0.500", "acc 0.250", "kl 1.2e-12", "step 2.6s", "eval/pass@1 0.700"):
        assert part in line, (part, line)
    assert "is/ratio_max" not in line
    assert "SKIPPED" in console_line(4, 70, {"reward/mean": 0.1, "train/skipped_nonfinite": 1.0})


def test_logger_prints_one_line_per_step_and_writes_every_metric(tmp_path, capsys):
    cfg = SimpleNamespace(logger=SimpleNamespace(console=True, wandb_mode="disabled", project="m3rl"),
                          trainer=SimpleNamespace(total_training_steps=2))
    logger = MetricsLogger(tmp_path, cfg, {}, enabled=True)
    long_row = {"reward/mean": 0.5, "reward/acc": 0.5, "train_rollout/kl_k3": 1e-12, "time/step_s": 2.0,
                **{f"verl/metric_{i}": float(i) for i in range(40)}}
    logger.log(1, long_row)
    logger.log(2, long_row)
    out = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    assert len(out) == 2 and out[0].startswith("step 1/2") and out[1].startswith("step 2/2")
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2 and rows[0]["verl/metric_39"] == 39.0
