#!/usr/bin/env python
"""Quantize a bf16 MiniMax-M3 checkpoint (vLLM / MiniMax tensor names) into the format it is served in.

    python scripts/quantize_checkpoint.py --in BF16_DIR --out DIR [--max-shard-gb 4]

- Routed experts (``block_sparse_moe.experts.E.w1/w2/w3``) -> NVFP4, ModelOpt convention: one decode
  global scale per expert tensor, ``weight_scale_2 = amax / (6 * 448)``, except that an expert's gate
  (w1) and up (w3) share one scale, the max of both amaxes: vLLM serves the fused w13 with w1's scale
  only (it warns and mis-scales the up half otherwise). Codes and block scales are vLLM's reference
  quantizer (``ref_nvfp4_quant`` with encode scale 1 / weight_scale_2).
- Every other projection (attention q/k/v/o, the indexer's index_q/index_k, the dense MLP, the shared
  expert) -> MXFP8 (``weight_scale`` E8M0, vLLM's ceil rule).
- Router gate and its correction bias, embeddings, norms and lm_head are copied as they are.
- ``config.json`` gets a ModelOpt ``MIXED_PRECISION`` quantization_config listing every quantized
  module (vLLM reads it as ``modelopt_mixed``). Experts are declared ``W4A16_NVFP4``: no activation
  calibration is run, so there is no ``input_scale``, and declaring W4A4 ``NVFP4`` would have
  Blackwell kernels quantize activations with uncalibrated scales. Hopper serves NVFP4 experts W4A16
  either way.
- Tokenizer and other non-weight files are copied.

Tensors are read one at a time and shards are flushed as they fill, so peak memory is one output
shard plus one expert's bf16 weights.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from quant.checkpoint import (
    INDEX_FILE,
    CheckpointError,
    CheckpointWriter,
    QuantizedCheckpoint,
    mixed_precision_config,
    nvfp4_global_scale,
    quantize_mxfp8,
    quantize_nvfp4,
)

EXPERT_ALGO = "W4A16_NVFP4"
LINEAR_ALGO = "MXFP8"
_EXPERT = re.compile(r"^(?P<base>.+\.block_sparse_moe\.experts\.\d+)\.(?P<proj>w[123])$")
_MXFP8 = re.compile(r"\.(self_attn\.(q|k|v|o|index_q|index_k)_proj|mlp\.(gate|up|down)_proj|"
                    r"block_sparse_moe\.shared_experts\.(gate|up|down)_proj)$")
# Kept unquantized; listed in the config's ignore list so the intent is explicit to readers and vLLM.
IGNORE = ["lm_head", "model.embed_tokens", "*.block_sparse_moe.gate"]
# The tiny-model builder's manifest hashes the source files; copied here it would describe files
# that are not in this directory.
_NOT_COPIED = {"config.json", INDEX_FILE, "tiny_model.json"}


def plan(prefix: str) -> str | None:
    """The quant algo a module of the bf16 checkpoint gets (None: copied as it is)."""
    if _EXPERT.match(prefix):
        return EXPERT_ALGO
    if _MXFP8.search(prefix):
        return LINEAR_ALGO
    return None


def _write_nvfp4_group(writer: CheckpointWriter, ckpt: QuantizedCheckpoint, group: list[str]) -> None:
    # A function of its own so the bf16 weights are released on return, before the next expert is read.
    weights = {p: ckpt.tensor(f"{p}.weight") for p in group}
    gs = nvfp4_global_scale(*weights.values())
    for p, w in weights.items():
        writer.add_module(p, quantize_nvfp4(w, gs, name=f"{p}.weight"))


def quantize_checkpoint(in_dir, out_dir, max_shard_bytes: int = 4 << 30) -> dict:
    """Convert ``in_dir`` into ``out_dir`` (created; must not hold a checkpoint); return a summary."""
    src, out = Path(in_dir), Path(out_dir)
    ckpt = QuantizedCheckpoint(src)
    if ckpt.scheme is not None:
        raise CheckpointError(f"{src}/config.json: already has a quantization_config; expected a bf16 checkpoint")
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty")
    modules = ckpt.modules()
    algos = {p: a for p in modules if (a := plan(p)) is not None}
    done: set[str] = set()
    with CheckpointWriter(out, max_shard_bytes) as writer:
        for name in ckpt.tensor_names():
            prefix, _, suffix = name.rpartition(".")
            if suffix != "weight" or prefix not in algos:
                writer.add(name, ckpt.tensor(name))  # biases of quantized modules included
                continue
            if prefix in done:
                continue
            if algos[prefix] == LINEAR_ALGO:
                writer.add_module(prefix, quantize_mxfp8(ckpt.tensor(name), name=name))
                done.add(prefix)
                continue
            m = _EXPERT.match(prefix)
            group = [prefix]
            if m["proj"] in ("w1", "w3"):  # gate and up of one expert share one global scale
                group = [f"{m['base']}.w1", f"{m['base']}.w3"]
                missing = [p for p in group if p not in modules]
                if missing:
                    raise CheckpointError(f"{missing[0]}.weight: missing (needed for the shared w1/w3 global scale)")
            _write_nvfp4_group(writer, ckpt, group)
            done.update(group)
    for f in sorted(src.iterdir()):
        if f.is_file() and f.suffix != ".safetensors" and f.name not in _NOT_COPIED:
            shutil.copy2(f, out / f.name)
    config = dict(ckpt.config)
    config["quantization_config"] = mixed_precision_config(algos, IGNORE)
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    QuantizedCheckpoint(out)  # re-open: the written layout must pass the reader's checks
    counts = {a: sum(1 for x in algos.values() if x == a) for a in sorted(set(algos.values()))}
    return {"modules": counts, "copied_modules": len(modules) - len(algos)}
