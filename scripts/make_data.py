"""Write the built-in task (2-digit boxed addition) as verl-schema parquet: DIR/train.parquet, DIR/eval.parquet.

    python scripts/make_data.py --out data/add2 [--n-train N] [--n-eval M] [--seed S]

The split is by a hash of the question text, so it is the same for every N, M and seed; the seed only
picks and orders the training rows. Nothing is downloaded.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from rl.data import load_verl_parquet, make_addition_splits, write_rows  # noqa: E402


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--n-train", type=int, default=None, help="training rows (default: all 7,303)")
    p.add_argument("--n-eval", type=int, default=500, help="eval rows (default 500 of 797)")
    p.add_argument("--seed", type=int, default=0, help="picks and orders the training rows")
    p.add_argument("--eval-mod", type=int, default=10, help="1 in eval-mod questions goes to eval")
    args = p.parse_args(argv)

    train, evals = make_addition_splits(args.n_train, args.n_eval, args.seed, args.eval_mod)
    summary = {"seed": args.seed, "eval_mod": args.eval_mod}
    for name, rows in (("train", train), ("eval", evals)):
        path = args.out / f"{name}.parquet"
        write_rows(rows, path)
        # Read back through the loader the trainer uses: a row it would drop is a bug here.
        _, report = load_verl_parquet(path, on_bad_row="error")
        summary[name] = {"path": str(path), "rows": report.n_kept}
    print(json.dumps(summary, indent=2))
    return summary


if __name__ == "__main__":
    main()
