"""Per-step metrics: every metric to JSONL in the run folder and W&B (offline by default: `<run_dir>/wandb/`); one
line per step on the console (reward, accuracy, train/rollout KL, step time). At each eval: the eval curve, a W&B
table of sample rollouts and the plots (`<run_dir>/plots/*.png`, also to W&B); at the end the final adapter as a W&B
artifact."""

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
        self.run_dir = Path(run_dir)
        if cfg.logger.wandb_mode != "disabled" and enabled:
            import wandb

            lg = cfg.logger
            self.wandb = wandb.init(project=lg.project, entity=getattr(lg, "entity", None), mode=str(lg.wandb_mode),
                                    dir=str(run_dir), config=resolved_config, resume="allow",
                                    name=getattr(lg, "experiment_name", None) or run_dir.name,
                                    id=run_dir.name.replace("/", "-"))
        self.rows, self.evals = [], []
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

    def log_eval(self, step: int, metrics: dict, samples: list[dict] | None = None) -> None:
        """One eval (before training: step 0): its metrics on the eval curve, the table of the last step's sample
        rollouts (when there was a step), and the plots rewritten."""
        self.evals.append({"step": step, **metrics})
        if not self.enabled:
            return
        with open(self.run_dir / "evals.jsonl", "a") as f:
            f.write(json.dumps({"step": step, **metrics}) + "\n")
        if self.wandb is not None:
            import wandb

            data = {f"eval/{k}": v for k, v in metrics.items() if isinstance(v, (int, float))}
            if samples:
                cols = list(samples[0])
                data["rollouts"] = wandb.Table(columns=cols, data=[[r[c] for c in cols] for r in samples])
            self.wandb.log(data, step=step)
        self.plot(step)

    def plot(self, step: int) -> list[Path]:
        from rl.plots import write_plots  # matplotlib: only in the process that writes

        paths = write_plots(self.rows, self.evals, self.run_dir / "plots")
        if self.wandb is not None:
            import wandb

            self.wandb.log({f"plots/{p.stem}": wandb.Image(str(p)) for p in paths}, step=step)
        return paths

    def log_artifact(self, path, kind: str = "model") -> None:
        """The directory `path` as a W&B artifact named `<dir name>-<run id>`."""
        if self.wandb is not None:
            import wandb

            artifact = wandb.Artifact(name=f"{Path(path).name}-{self.wandb.id}", type=kind)
            artifact.add_dir(str(path))
            self.wandb.log_artifact(artifact)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()
