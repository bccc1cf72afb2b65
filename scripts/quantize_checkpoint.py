#!/usr/bin/env python
"""Quantize a bf16 MiniMax-M3 checkpoint into the format it is served in (NVFP4 routed experts, MXFP8 other
projections); the conventions are documented in quant/convert.py.

    python scripts/quantize_checkpoint.py --in BF16_DIR --out DIR [--max-shard-gb 4]
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install

from quant.checkpoint import CheckpointError  # noqa: E402
from quant.convert import quantize_checkpoint  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in", dest="src", required=True, help="bf16 checkpoint directory (vLLM/MiniMax names)")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--max-shard-gb", type=float, default=4.0, help="safetensors shard size (GiB)")
    args = ap.parse_args(argv)
    try:
        summary = quantize_checkpoint(args.src, args.out, int(args.max_shard_gb * (1 << 30)))
    except (CheckpointError, FileExistsError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
