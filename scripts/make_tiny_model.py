#!/usr/bin/env python
"""Write a deterministic random-init tiny MiniMax-M3 checkpoint: DIR for vLLM, DIR-hf for transformers.

    python scripts/make_tiny_model.py --out build/m3s
    python scripts/make_tiny_model.py --out build/m3s-kv2 num_attention_heads=4 num_key_value_heads=2
    python scripts/make_tiny_model.py --out build/m3s-nosparse 'sparse_attention_freq=[0,0,0,0]'

Overrides are KEY=VALUE text_config keys (sparse_* keys go into sparse_attention_config); VALUE is
parsed as JSON, falling back to a plain string. See m3/config.py for defaults and checks (m3/tiny.py builds it).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from m3.config import DTYPES  # noqa: E402
from m3.tiny import make_tiny_model


def parse_override(text: str) -> tuple[str, object]:
    key, sep, raw = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw  # e.g. hidden_act=swigluoai


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="vLLM checkpoint dir; the HF twin goes to OUT-hf")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    ap.add_argument("overrides", nargs="*", type=parse_override, metavar="KEY=VALUE")
    args = ap.parse_args(argv)
    try:
        paths = make_tiny_model(args.out, seed=args.seed, dtype=args.dtype, **dict(args.overrides))
    except (ValueError, FileExistsError) as e:  # config errors name the field; no traceback needed
        ap.exit(2, f"{ap.prog}: error: {e}\n")
    print(f"vLLM checkpoint:   {paths.vllm}\ntransformers twin: {paths.hf}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
