"""Write the built-in task (2-digit addition) as parquet files. Nothing is downloaded.

    python scripts/make_data.py --out data/add2 [--n-train N] [--n-eval M] [--seed S]
        verl schema, boxed answers: DIR/train.parquet, DIR/eval.parquet
    python scripts/make_data.py --out data/math --layout dapo [--n-train N] [--n-eval M]
        the public layouts of the recipe's data, with the same problems in DAPO's "Answer:" prompt:
        DIR/dapo-math-17k.parquet (verl schema, data_source math_dapo, each problem twice as the Hub file repeats
        them) and the eval split as AIME-2024 in the three layouts rl.data reads: aime-2024-verl.parquet (verl
        schema, 4 copies per problem), aime-2024-pascal.parquet (ID, Problem, Solution, Answer int64) and
        aime-2024-lower.parquet (id int64, problem, solution, answer string, url, year)

The split is by a hash of the question text, so it is the same for every N, M and seed; the seed only
picks and orders the training rows.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from rl.data import (  # noqa: E402
    AIME_SOURCE,
    DAPO_PROMPT,
    load_aime_2024,
    load_dapo_math_17k,
    load_verl_parquet,
    make_addition_splits,
    write_rows,
)


def _question(row: dict) -> tuple[str, str]:
    return f"What is {row['extra_info']['a']} + {row['extra_info']['b']}?", str(row["reward_model"]["ground_truth"])


def _dapo_row(question: str, answer: str, source: str, index: int) -> dict:
    return {"data_source": source, "prompt": [{"role": "user", "content": DAPO_PROMPT.format(problem=question)}],
            "ability": "MATH", "reward_model": {"ground_truth": answer, "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": index, "split": "train"}}


def write_public_layouts(train: list[dict], evals: list[dict], out: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    dapo = [_dapo_row(*_question(r), "math_dapo", i) for i, r in enumerate(train) for _ in range(2)]
    problems = [_question(r) for r in evals]
    files = {"dapo-math-17k.parquet": dapo,
             "aime-2024-verl.parquet": [_dapo_row(q, a, AIME_SOURCE, 4 * i + k)
                                        for i, (q, a) in enumerate(problems) for k in range(4)]}
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in files.items():
        write_rows(rows, out / name)
    pq.write_table(pa.table({"ID": [f"2024-I-{i}" for i in range(len(problems))], "Problem": [q for q, _ in problems],
                             "Solution": ["" for _ in problems],
                             "Answer": pa.array([int(a) for _, a in problems], pa.int64())}),
                   out / "aime-2024-pascal.parquet")
    pq.write_table(pa.table({"id": pa.array(list(range(len(problems))), pa.int64()),
                             "problem": [q for q, _ in problems], "solution": ["" for _ in problems],
                             "answer": [a for _, a in problems], "url": ["" for _ in problems],
                             "year": ["2024" for _ in problems]}), out / "aime-2024-lower.parquet")
    # Read back through the loaders the trainer uses: a row they would drop is a bug here.
    summary = {"dapo-math-17k.parquet": load_dapo_math_17k(out / "dapo-math-17k.parquet", on_bad_row="error")[1]}
    for layout in ("verl", "pascal", "lower"):
        summary[f"aime-2024-{layout}.parquet"] = load_aime_2024(out / f"aime-2024-{layout}.parquet",
                                                                on_bad_row="error")[1]
    return {name: {"path": str(out / name), "rows": r.n_kept, "layout": r.layout} for name, r in summary.items()}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path, help="output directory")
    p.add_argument("--n-train", type=int, default=None, help="training rows (default: all 7,303)")
    p.add_argument("--n-eval", type=int, default=500, help="eval rows (default 500 of 797)")
    p.add_argument("--seed", type=int, default=0, help="picks and orders the training rows")
    p.add_argument("--eval-mod", type=int, default=10, help="1 in eval-mod questions goes to eval")
    p.add_argument("--layout", choices=("verl", "dapo"), default="verl",
                   help="verl: the built-in task's files; dapo: DAPO-Math-17K + AIME-2024 public layouts")
    args = p.parse_args(argv)

    train, evals = make_addition_splits(args.n_train, args.n_eval, args.seed, args.eval_mod)
    summary = {"seed": args.seed, "eval_mod": args.eval_mod}
    if args.layout == "dapo":
        summary.update(write_public_layouts(train, evals, args.out))
        print(json.dumps(summary, indent=2))
        return summary
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
