"""Per-step metrics: every metric to JSONL in the run folder and W&B (offline by default); one line per step on the
console (reward, accuracy, train/rollout KL, step time)."""

import json
import math
from pathlib import Path

from rich.console import Console

# (metric, label, format) of the console line
CONSOLE_FIELDS = (("reward/mean", "reward", ".3f"), ("reward/acc", "acc", ".3f"), ("train_rollout/kl_k3", "kl", ".1e"),
                  ("train/grad_norm", "grad", ".3f"), ("time/generate_s", "gen", ".1f"), ("time/step_s", "step", ".1f"))


def console_line(step: int, total: int, metrics: dict) -> str:
    parts = [f"step {step}/{total}"]
    for key, label, fmt in CONSOLE_FIELDS:
        if isinstance(metrics.get(key), (int, float)):
            parts.append(f"{label} {metrics[key]:{fmt}}" + ("s" if key.startswith("time/") else ""))
    if metrics.get("train/skipped_nonfinite"):
        parts.append("SKIPPED (non-finite)")
    parts += [f"{k} {v:.3f}" for k, v in metrics.items() if k.startswith("eval/") and isinstance(v, float)]
    return "  ".join(parts)


class MetricsLogger:
    def __init__(self, run_dir: Path, cfg, resolved_config: dict, enabled: bool = True):
        self.path = run_dir / "metrics.jsonl"
        self.enabled = enabled  # rank 0 of a torchrun run writes; the others only keep rows
        self.console = Console() if cfg.logger.console and enabled else None
        self.wandb = None
        if cfg.logger.wandb_mode != "disabled" and enabled:
            import wandb

            self.wandb = wandb.init(project=cfg.logger.project, mode=cfg.logger.wandb_mode, dir=str(run_dir),
                                    config=resolved_config, resume="allow", id=run_dir.name.replace("/", "-"))
        self.rows = []
        self.total = cfg.trainer.total_training_steps

    def log(self, step: int, metrics: dict) -> None:
        row = {"step": step, **{k: (None if isinstance(v, float) and not math.isfinite(v) else v)
                                for k, v in metrics.items()}}
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(row) + "\n")
        if self.wandb is not None:
            self.wandb.log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, step=step)
        self.rows.append(row)
        if self.console is not None:
            self.console.print(console_line(step, self.total, metrics), highlight=False, soft_wrap=True)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
