"""Run checkpoints: adapter (peft format), optimizer, RNG states, data cursor, step — written atomically, so a run
killed at any moment (SIGKILL included) resumes from the last complete checkpoint to the same adapter bytes."""

import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch

from rl.model.lora import load_adapter_tensors, write_adapter


def save(run_dir: Path, step: int, adapter_fp32: dict, lora_cfg, optimizer, cursor, extra: dict) -> Path:
    """adapter_fp32: the full (gathered) LoRA tensors in fp32, the exact trained values. The optimizer state is
    saved only for a single-rank run (a sharded one cannot be resumed yet: rl.train refuses that)."""
    ckpt_root = run_dir / "checkpoints"
    final = ckpt_root / f"step_{step:06d}"
    tmp = ckpt_root / f".step_{step:06d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    write_adapter(adapter_fp32, lora_cfg, tmp / "adapter")
    if optimizer is not None:
        torch.save({"optimizer": optimizer.state_dict(), "torch_rng": torch.get_rng_state(),
                    "python_rng": random.getstate(), "numpy_rng": np.random.get_state()}, tmp / "state.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, "cursor": cursor.state_dict(), **extra}, indent=2))
    with open(tmp / "meta.json") as f:
        os.fsync(f.fileno())
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)  # the checkpoint exists only once complete
    (ckpt_root / "latest.tmp").write_text(final.name)
    os.replace(ckpt_root / "latest.tmp", ckpt_root / "latest")
    return final


def latest(run_dir: Path) -> Path | None:
    pointer = run_dir / "checkpoints" / "latest"
    if not pointer.is_file():
        return None
    path = run_dir / "checkpoints" / pointer.read_text().strip()
    return path if (path / "meta.json").is_file() else None


def load(path: Path, model, optimizer, cursor) -> dict:
    from safetensors.torch import load_file

    load_adapter_tensors(model, load_file(str(path / "adapter" / "adapter_model.safetensors")))
    state = torch.load(path / "state.pt", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    np.random.set_state(state["numpy_rng"])
    meta = json.loads((path / "meta.json").read_text())
    cursor.load_state_dict(meta["cursor"])
    return meta
