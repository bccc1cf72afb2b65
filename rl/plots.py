"""The run's curves as PNGs in `<run_dir>/plots/` (matplotlib, Agg: no display), rewritten at every eval and at the
end from the metrics rows and the eval history; `rl.metrics` also logs them to W&B."""

import math
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: files only, never a window
import matplotlib.pyplot as plt  # noqa: E402

SIZE_IN, DPI = (6.4, 4.0), 100  # every PNG is 640 x 400 pixels

# (file, title, [(metric, label)], y scale); eval metrics come from the eval history, the others from the step rows
PANELS = (
    ("reward", "reward and accuracy (training rollouts)", [("reward/mean", "reward"), ("reward/acc", "accuracy")],
     "linear"),
    ("eval", "eval over steps", [("pass@1", "pass@1 (sampled)"), ("pass@k", "pass@k"), ("greedy_pass@1", "greedy"),
                                 ("maj@k", "maj@k (verl)")], "linear"),
    ("train_rollout", "trainer vs engine (response tokens)",
     [("train_rollout/kl_k3", "KL k3"), ("train_rollout/logprob_abs_diff_mean", "mean |dlogprob|"),
      ("train_rollout/logprob_abs_diff_max", "max |dlogprob|")], "log"),
    ("is_ratio", "token IS ratio (after the cap)", [("is/ratio_mean", "mean"), ("is/ratio_max", "max"),
                                                     ("is/capped_frac", "capped fraction")], "linear"),
    ("agreement", "trainer's own choice = engine's", [("agreement/routing", "routing"), ("agreement/blocks", "blocks")],
     "linear"),
    ("grad_norm", "gradient norm (before clipping)", [("train/grad_norm", "grad norm")], "linear"),
)
TIME_PARTS = (("time/generate_s", "generate"), ("time/score_s", "score"), ("time/train_s", "train"),
              ("time/sync_s", "sync"))


def _series(rows: list[dict], key: str) -> tuple[list[int], list[float]]:
    pts = [(r["step"], r[key]) for r in rows if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _figure(title: str):
    fig, ax = plt.subplots(figsize=SIZE_IN, dpi=DPI)
    ax.set_title(title)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    return fig, ax


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)  # no bbox_inches="tight": the pixel size stays fixed
    plt.close(fig)
    return path


def write_plots(rows: list[dict], evals: list[dict], out_dir) -> list[Path]:
    """One PNG per panel, plus the stacked step-time breakdown. `evals`: {"step": s, "pass@1": ..} per eval, where
    `maj@k` stands for verl's maj@<k>. A panel with no data still gets a file saying so."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    evals = [{**e, "maj@k": e.get(f"maj@{e.get('k')}")} for e in evals]
    written = []
    for name, title, keys, scale in PANELS:
        fig, ax = _figure(title)
        source = evals if name == "eval" else rows
        drawn = 0
        for key, label in keys:
            xs, ys = _series(source, key)
            if scale == "log":
                xs, ys = [x for x, y in zip(xs, ys) if y > 0], [y for y in ys if y > 0]
            if xs:
                ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3, label=label)
                drawn += 1
        if drawn:
            ax.set_yscale(scale)
            ax.legend(loc="best", fontsize=8)
        else:
            ax.text(0.5, 0.5, "no data yet", ha="center", va="center", transform=ax.transAxes)
        written.append(_save(fig, out / f"{name}.png"))
    fig, ax = _figure("step time breakdown (s)")
    timed = [r for r in rows if all(isinstance(r.get(k), (int, float)) for k, _ in TIME_PARTS)]
    steps, bottom = [r["step"] for r in timed], [0.0] * len(timed)
    for key, label in TIME_PARTS:
        vals = [r[key] for r in timed]
        ax.bar(steps, vals, bottom=bottom, label=label, width=0.8)
        bottom = [b + v for b, v in zip(bottom, vals)]
    if steps:
        ax.legend(loc="best", fontsize=8)
    written.append(_save(fig, out / "step_time.png"))
    return written
