"""Summarize `python -m rl.train` runs (summary.json + metrics.jsonl of each run folder) into one JSON: per seed the
eval before/after, the training-reward trend, the per-step rewards and the time split; across seeds the spread.

Usage: python scripts/summarize_train_runs.py --runs runs/seed0 runs/seed1 runs/seed2 --wall 512 530 498 \
           --command "make train TRAIN_ARGS='trainer.seed=S ...'" --out results/make_train_cpu.json
"""

import argparse
import json
import statistics
from pathlib import Path


def summarize(run: Path, wall_s: float | None) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rewards = [r["reward/mean"] for r in rows]
    first, last = statistics.mean(rewards[:5]), statistics.mean(rewards[-5:])
    before, after = summary["eval_before"]["pass@1"], summary["eval_after"]["pass@1"]

    def med(key):
        vals = [r[key] for r in rows if isinstance(r.get(key), (int, float))]
        return float(f"{statistics.median(vals):.4g}") if vals else None

    return {
        "run_dir": str(run), "seed": summary.get("seed"), "wall_s": wall_s, "warmup": summary.get("warmup"),
        "eval_pass@1": {"before": before, "after": after, "gain": round(after - before, 4),
                        "what": "mean accuracy of k samples per problem at the rollout temperature"},
        "eval_greedy_pass@1": {k: summary[f"eval_{k}"].get("greedy_pass@1") for k in ("before", "after")},
        "reward": {"first5_mean": round(first, 4), "last5_mean": round(last, 4), "gain": round(last - first, 4),
                   "per_step": [round(x, 4) for x in rewards]},
        "groups_mixed_frac": {"first5_mean": round(statistics.mean(r["groups/mixed_frac"] for r in rows[:5]), 3),
                              "last5_mean": round(statistics.mean(r["groups/mixed_frac"] for r in rows[-5:]), 3)},
        "median": {k: med(k) for k in ("train/grad_norm", "time/generate_s", "time/train_s", "time/sync_s",
                                       "time/step_s", "sync/ms", "train_rollout/kl_k3")},
        "steps": len(rows), "nonfinite_steps": summary.get("nonfinite_steps"),
        "check_step0_passed": summary.get("check_step0", {}).get("passed"),
        "meets": {"eval_gain_>=_0.15": after - before >= 0.15, "reward_gain_>=_0.10": last - first >= 0.10,
                  "wall_<=_600s": None if wall_s is None else wall_s <= 600},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", nargs="+", required=True)
    ap.add_argument("--wall", nargs="*", type=float, default=[])
    ap.add_argument("--command", required=True)
    ap.add_argument("--notes", default=None, help="a JSON file merged in under 'analysis'")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    walls = args.wall + [None] * (len(args.runs) - len(args.wall))
    runs = [summarize(Path(r), w) for r, w in zip(args.runs, walls)]
    gains = [r["eval_pass@1"]["gain"] for r in runs]
    out = {"command": args.command, "runs": runs,
           "across_seeds": {"eval_gain_min": min(gains), "eval_gain_max": max(gains),
                            "eval_gain_mean": round(statistics.mean(gains), 4),
                            "eval_gain_stdev": round(statistics.stdev(gains), 4) if len(gains) > 1 else None,
                            "all_meet": all(all(v is not False for v in r["meets"].values()) for r in runs)}}
    if args.notes:
        out["analysis"] = json.loads(Path(args.notes).read_text())
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["across_seeds"], indent=1))


if __name__ == "__main__":
    main()
