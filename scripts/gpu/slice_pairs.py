"""Quantized vs bf16 trainer-slice pairs from one device call (`run.sh pairs:...`), as one JSON.

Each round ran the quantized and the bf16 slice back to back (scripts/train_step_m3.py, alternating which goes first,
so that a drift of the machine's clocks over the call does not favour one), and with base/ also base/'s quantized
slice (another commit's code, e.g. before a change) in between. The ratios are per round, side by side on one machine;
their median is the number to read (H200 rounds spread by ~0.5%, results/gpu/issue19_targets.json session_19).

    python scripts/gpu/slice_pairs.py DIR --out DIR/pairs.json   (DIR holds r<i>_<config>.json)
"""

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

CONFIGS = ("quantized", "bf16", "base_quantized")


def load(folder: Path) -> dict:
    """{round: {config: the slice's JSON}}; a slice that wrote no JSON (failed, or cut by the budget) is absent."""
    rounds: dict = {}
    for f in sorted(folder.glob("r*_*.json")):
        m = re.fullmatch(r"r(\d+)_(\w+)\.json", f.name)
        if m and m.group(2) in CONFIGS:
            rounds.setdefault(int(m.group(1)), {})[m.group(2)] = json.loads(f.read_text())
    return rounds


def shared_settings(rounds: dict) -> dict:
    """The slices' settings but `base`, which all must share: slices run otherwise (other MoE chunks, layers, steps)
    make a ratio that is not a pair. A ValueError names the slice and the keys that differ."""
    seen, first = None, None
    for i in sorted(rounds):
        for cfg, r in sorted(rounds[i].items()):
            if "settings" not in r:
                raise ValueError(f"r{i}_{cfg}.json has no 'settings': not a scripts/train_step_m3.py result")
            s = {k: v for k, v in r["settings"].items() if k != "base"}
            if seen is None:
                seen, first = s, f"r{i}_{cfg}"
            elif s != seen:
                keys = sorted(k for k in s.keys() | seen.keys() if s.get(k) != seen.get(k))
                raise ValueError(f"r{i}_{cfg}.json differs from {first}.json in settings {keys}: not a pair")
    return seen


def summarize(rounds: dict) -> dict:
    rows, q_bf16, q_base = [], [], []
    for i in sorted(rounds):
        r = rounds[i]
        tok = {c: r[c]["tokens_per_s"] for c in CONFIGS if c in r and r[c].get("tokens_per_s")}
        row = {"round": i, "first": "bf16" if i % 2 else "quantized",
               "tokens_per_s": {c: round(v) for c, v in tok.items()},
               "peak_gb": {c: round(r[c]["peak_allocated_gb_max"], 1) for c in tok},
               "mfu": {c: round(r[c]["mfu_vs_989_tflops"], 4) for c in tok}}
        if "quantized" in tok and "bf16" in tok:
            row["quantized_over_bf16"] = round(tok["quantized"] / tok["bf16"], 4)
            q_bf16.append(row["quantized_over_bf16"])
        if "quantized" in tok and "base_quantized" in tok:
            row["quantized_over_base"] = round(tok["quantized"] / tok["base_quantized"], 4)
            q_base.append(row["quantized_over_base"])
        rows.append(row)
    out = {"settings": shared_settings(rounds), "rounds": rows, "complete_pairs": len(q_bf16)}
    for name, xs in (("quantized_over_bf16", q_bf16), ("quantized_over_base", q_base)):
        if xs:
            out[name] = {"median": round(statistics.median(xs), 4), "min": min(xs), "max": max(xs), "n": len(xs)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--meta", default="{}", help="JSON merged into the result (the command, the slice's settings)")
    args = p.parse_args(argv)
    rounds = load(args.folder)
    if not rounds:
        print(f"slice_pairs: no r<i>_<config>.json in {args.folder}", file=sys.stderr)
        return 1
    try:
        result = {**json.loads(args.meta), **summarize(rounds)}
    except ValueError as e:
        print(f"slice_pairs: {e}", file=sys.stderr)
        return 1
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["rounds"]:
        print("pair", json.dumps(row))
    print("pairs", json.dumps({k: v for k, v in result.items() if k != "rounds"}))
    return 0 if result["complete_pairs"] else 1


if __name__ == "__main__":
    sys.exit(main())
