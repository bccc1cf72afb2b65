"""The dry run (`python -m rl.train ... trainer.dry_run=true`): everything a run would read, checked without loading
a weight, and the plan printed as one JSON object.

- the whole config (rl.config.validate);
- the checkpoint: config.json, then the safetensors headers (names, dtypes, shapes): every tensor the trainer and
  the engine need, in the served format: NVFP4 routed experts (ModelOpt `weight`/`weight_scale`/`weight_scale_2`
  or compressed-tensors `weight_packed`/`weight_scale`/`weight_global_scale`; per expert or fused
  `experts.gate_up_proj`/`down_proj`), MXFP8 projections, the rest as stored; and whether the trainer's reader
  (quant.checkpoint) opens it;
- the data files' schemas and rows (rl.data), and how many prompts are too long for `data.max_prompt_length`;
- the plan: ranks, engine TP/DP layout, tokens per step, per-GPU memory of trainer and engine (rl.sizing).
Problems are collected and reported together (each naming its key or tensor); any makes the dry run exit 1.
"""

import json
from pathlib import Path

import numpy as np
from omegaconf import OmegaConf

from m3.weights import weight_specs
from quant.checkpoint import QuantizedCheckpoint, read_headers
from rl.config import validate, world_size
from rl.data import load_splits
from rl.prompts import prompt_lengths
from rl.sizing import Setup, Shape, load_m3_config, setup_from_config, size

NVFP4_LAYOUTS = {  # companion tensors of a packed E2M1 weight, by checkpoint layout
    "modelopt": ("weight", "weight_scale", "weight_scale_2"),
    "compressed-tensors": ("weight_packed", "weight_scale", "weight_global_scale"),
}


def _headers(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """tensor name -> (dtype, shape), from the safetensors headers only (quant.checkpoint's reader)."""
    return {name: (i.dtype, i.shape) for name, i in read_headers(path).items()}


def _kind(module: str) -> str:
    if ".experts." in module:
        return "nvfp4"
    if module.endswith(("_proj", ".w1", ".w2", ".w3")):
        return "mxfp8"
    return "stored"


def _nvfp4_problems(module: str, shape: tuple[int, ...], headers: dict) -> tuple[str | None, list[str]]:
    """(layout found, problems) for one NVFP4 module of unquantized shape [..., N, K]."""
    for layout, (w, scale, gs) in NVFP4_LAYOUTS.items():
        if f"{module}.{w}" not in headers:
            continue
        problems = []
        dtype, got = headers[f"{module}.{w}"]
        if dtype != "U8" or got[-2:] != (shape[-2], shape[-1] // 2):
            problems.append(f"{module}.{w}: {dtype} {list(got)}; NVFP4 needs U8 [.., {shape[-2]}, {shape[-1] // 2}]")
        for name in (scale, gs):
            if f"{module}.{name}" not in headers:
                problems.append(f"{module}.{name}: missing ({layout} NVFP4)")
        return layout, problems
    return None, [f"{module}: no NVFP4 weight ({' or '.join(f'{v[0]}' for v in NVFP4_LAYOUTS.values())})"]


def check_checkpoint(path: Path, text_config: dict) -> dict:
    """Every module the model needs, in the served format; fused expert stacks accepted for routed experts."""
    headers = _headers(path)
    specs = weight_specs(text_config)
    problems, layouts, fused_layers = [], set(), set()
    for name, (shape, _, _) in specs.items():
        module = name.removesuffix(".weight")
        kind = _kind(module)
        if kind == "nvfp4":
            layer = module.split(".experts.")[0]
            if f"{layer}.experts.gate_up_proj.weight" in headers or f"{layer}.experts.gate_up_proj.weight_packed" \
                    in headers:
                fused_layers.add(layer)
                continue
            layout, found = _nvfp4_problems(module, shape, headers)
            layouts.add(layout)
            problems += found
        elif kind == "mxfp8":
            dtype, got = headers.get(f"{module}.weight", (None, None))
            if dtype is None:
                problems.append(f"{module}.weight: missing")
            elif dtype == "F8_E4M3" and not any(f"{module}.{s}" in headers for s in ("weight_scale",
                                                                                     "weight_scale_inv")):
                problems.append(f"{module}.weight_scale: missing (MXFP8)")
            elif got != shape:
                problems.append(f"{module}.weight: shape {list(got)}, the config gives {list(shape)}")
        elif name not in headers:
            problems.append(f"{name}: missing")
    for layer in sorted(fused_layers):  # [E, 2I, H/2] and [E, H, I/2] stacks
        for proj in ("gate_up_proj", "down_proj"):
            if not any(f"{layer}.experts.{proj}.{w[0]}" in headers for w in NVFP4_LAYOUTS.values()):
                problems.append(f"{layer}.experts.{proj}: missing (fused experts)")
        layouts.add("fused")
    can_load, why = True, None
    try:
        QuantizedCheckpoint(path)
    except Exception as e:  # noqa: BLE001  (reported: the trainer could not open it)
        can_load, why = False, f"{type(e).__name__}: {e}"
    return {"path": str(path), "tensors": len(headers), "modules_checked": len(specs),
            "expert_layouts": sorted(x for x in layouts if x), "problems": problems[:50],
            "n_problems": len(problems), "trainer_reader_opens_it": can_load, "trainer_reader_error": why}


def check_data(cfg, tokenizer_path: Path) -> dict:
    from transformers import AutoTokenizer

    train, evals, bad = load_splits(cfg.data)
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    limit = cfg.data.max_prompt_length
    # every prompt's length (4 bytes a row, rows read in batches): the run itself tokenizes them as drawn
    train_lengths, eval_lengths = prompt_lengths(train, tok), prompt_lengths(evals, tok)
    fit = np.sort(train_lengths[train_lengths <= limit])
    lengths = fit if len(fit) else np.zeros(1, np.int32)
    return {"train_rows": len(train), "val_rows": len(evals), **bad,
            "train_dropped_overlong": int((train_lengths > limit).sum()),
            "val_dropped_overlong": int((eval_lengths > limit).sum()),
            "prompt_tokens_median": int(lengths[len(lengths) // 2]), "prompt_tokens_max": int(lengths[-1]),
            "steps_per_epoch": len(fit) // cfg.data.train_batch_size}


def plan(cfg) -> dict:
    """The dry run's JSON object; raises ValueError listing every problem found."""
    validate(cfg)
    path = Path(cfg.model.path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model.path: no checkpoint (config.json) at {path}")
    raw = json.loads((path / "config.json").read_text())
    text_config = raw.get("text_config", raw)
    ckpt = check_checkpoint(path, text_config)
    data = check_data(cfg, path)
    world, tp = world_size(cfg), cfg.rollout.tensor_model_parallel_size
    sized = size(Shape.from_config(load_m3_config(str(path / "config.json"))), Setup(**setup_from_config(cfg)))
    seqs = cfg.data.train_batch_size * cfg.rollout.n
    gb = 1e9
    out = {
        "config": {"model": cfg.model.path, "train_files": cfg.data.train_files, "val_files": cfg.data.val_files,
                   "steps": cfg.trainer.total_training_steps},
        "ranks": world,
        "engine": {"tensor_parallel": tp, "replicas": world // tp, "expert_parallel": cfg.rollout.enable_expert_parallel,
                   "sequences_per_replica": -(-seqs // (world // tp)), "max_model_len": cfg.rollout.max_model_len,
                   "sleeps_while_training": cfg.rollout.free_cache_engine},
        "tokens_per_step": {"sequences": seqs, "max": seqs * (cfg.data.max_prompt_length + cfg.data.max_response_length),
                            "prompt_median_x_sequences": seqs * data["prompt_tokens_median"]},
        "memory_per_gpu_gb": {"trainer_peak": round(sized["trainer"]["peak"] / gb, 2),
                              "trainer_fits": sized["trainer"]["fits"],
                              "trainer_resident_while_rolling_out": round(
                                  sized["trainer"]["resident_during_rollout"] / gb, 2),
                              "engine": {k: round(v / gb, 2) for k, v in sized["engine"]["per_gpu"].items()},
                              "engine_concurrency": sized["engine"]["concurrency"],
                              "rollout_waves": sized["engine"]["rollout_waves"], "gpu_mem_gb": sized["setup"]["gpu_mem_gb"]},
        "checkpoint": ckpt,
        "data": data,
        "resolved": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True),
    }
    problems = list(ckpt["problems"])
    if not ckpt["trainer_reader_opens_it"]:
        problems.append(f"model.path: the trainer cannot read this checkpoint ({ckpt['trainer_reader_error']})")
    if data["train_rows"] - data["train_dropped_overlong"] < cfg.data.train_batch_size:
        problems.append(f"data.train_files: {data['train_rows'] - data['train_dropped_overlong']} usable prompts < "
                        f"data.train_batch_size={cfg.data.train_batch_size}")
    if problems:
        raise ValueError("dry run found problems:\n  " + "\n  ".join(problems[:30]))
    return out
