"""Per-step metrics: JSONL in the run folder, W&B (offline by default), a console table and a progress bar."""

import json
import math
from pathlib import Path

from rich.console import Console
from rich.table import Table

CONSOLE_KEYS = ("reward/mean", "reward/acc", "response/length", "train_rollout/kl_k3", "is/ratio_max",
                "is/capped_frac", "agreement/routing", "train/grad_norm", "sync/ms", "time/step_s")


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
            table = Table(title=f"step {step}", show_header=False, box=None)
            for k in (k for k in CONSOLE_KEYS if k in metrics):
                v = metrics[k]
                table.add_row(k, f"{v:.4g}" if isinstance(v, float) else str(v))
            self.console.print(table)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
