"""Run checkpoints, one folder per step, published only once complete (so a run killed at any moment, SIGKILL
included, resumes from the last complete one to the same adapter bytes and the same metrics):

  dcp/              torch.distributed.checkpoint: the LoRA parameters and the optimizer state, each rank writing its
                    own shards (tensors only: nothing in it is unpickled on load but DCP's own metadata, see _Reader)
  rng_rank<r>.json  every rank's RNG states (Python, NumPy, torch CPU, CUDA)
  state.json        step, world size, data cursor, LR schedule, optimizer hyperparameters (plain JSON)
  adapter/          the peft-format adapter in fp32, for users (rl.eval, rollout.serve, peft)
  manifest.json     sha256 of every file above; a folder without it, or with a file that does not match, is not a
                    checkpoint (resume warns, naming the file, and falls back to the one before)
"""

import hashlib
import json
import os
import pickle
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from rl.model.lora import write_adapter

FORMAT = 2
MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(RuntimeError):
    pass


# -- what is saved ----------------------------------------------------------------------------------------------
def _lora_state(model) -> dict:
    """The trainable (LoRA) parameters as the module holds them (FSDP2: this rank's DTensor shards), loaded in place.
    Not model.state_dict(): that also holds the frozen base, which the run re-reads from model.path."""
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    return {n: t for n, t in model.state_dict().items() if n in trainable}


def _optimizer_tensors(model, optimizer) -> dict:
    state = get_optimizer_state_dict(model, optimizer)["state"]  # FQN-keyed; initializes a fresh optimizer's state
    bad = [f"{k}.{n}" for k, s in state.items() for n, v in s.items() if not isinstance(v, torch.Tensor)]
    if bad:  # DCP would pickle them, and loading would then unpickle
        raise CheckpointError(f"optimizer state entries that are not tensors: {bad[:5]}")
    return state


def rng_state() -> dict:
    py = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state()
    out = {"python": [py[0], list(py[1]), py[2]], "numpy": [name, keys.tolist(), pos, has_gauss, cached],
           "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available():
        out["cuda"] = [s.tolist() for s in torch.cuda.get_rng_state_all()]
    return out


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(py[1]), py[2]))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


class _MetadataUnpickler(pickle.Unpickler):
    """DCP stores its index (`.metadata`) pickled; this reads it allowing only DCP's metadata classes and the torch
    and builtin types they hold, so a tampered file cannot run code."""

    # what torch 2.13's DCP writes: its metadata dataclasses, dtypes, Size, the layout decoder, a path
    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"), ("collections", "OrderedDict")}

    def find_class(self, module, name):
        if (module in ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.filesystem")
                or (module, name) in self.ALLOWED
                or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"DCP metadata refers to {module}.{name}, which a checkpoint index never holds")


class _Reader(dcp.FileSystemReader):
    def read_metadata(self, *args, **kwargs):
        from torch.distributed.checkpoint.metadata import BytesStorageMetadata, StorageMeta

        with open(Path(self.path) / ".metadata", "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if any(isinstance(m, BytesStorageMetadata) for m in metadata.state_dict_metadata.values()):
            raise CheckpointError(f"{self.path}: holds pickled objects, which this loader does not unpickle")
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# -- save -------------------------------------------------------------------------------------------------------
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json(path: Path, obj) -> None:
    with open(path, "w") as f:
        f.write(json.dumps(obj) + "\n")
        f.flush()
        os.fsync(f.fileno())


def step_dirs(run_dir: Path) -> list[Path]:
    """Published checkpoint folders, newest first."""
    root = Path(run_dir) / "checkpoints"
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))] \
        if root.is_dir() else []
    return [p for _, p in sorted(found, reverse=True)]


def save(run_dir: Path, step: int, *, model, optimizer, scheduler, cursor, adapter_fp32: dict, lora_cfg,
         extra: dict, rank: int = 0, world: int = 1, barrier=lambda: None, keep: int | None = None) -> Path:
    """A collective under torchrun: every rank calls it. adapter_fp32: the gathered LoRA in fp32 on rank 0 (the
    others may pass {}). keep: the newest this many checkpoints stay, older ones are deleted (None: all)."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step:06d}", root / f".step_{step:06d}.tmp"
    if rank == 0:
        for stale in root.glob(".step_*.tmp"):  # left by a run killed while saving
            shutil.rmtree(stale, ignore_errors=True)
        tmp.mkdir(parents=True)
    barrier()
    dcp.save({"model": _lora_state(model), "optim": _optimizer_tensors(model, optimizer)},
             storage_writer=dcp.FileSystemWriter(tmp / "dcp", sync_files=True), no_dist=world == 1)
    _write_json(tmp / f"rng_rank{rank}.json", rng_state())
    barrier()  # every rank's files are complete
    if rank == 0:
        write_adapter(adapter_fp32, lora_cfg, tmp / "adapter")
        groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        _write_json(tmp / "state.json", {"format": FORMAT, "step": step, "world": world, "cursor": cursor.state_dict(),
                                         "scheduler": scheduler.state_dict(), "param_groups": groups, **extra})
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        _write_json(tmp / MANIFEST, {"format": FORMAT, "step": step,
                                     "files": {str(p.relative_to(tmp)): _sha256(p) for p in files}})
        if final.exists():  # a step redone after a resume from an older checkpoint
            shutil.rmtree(final)
        tmp.rename(final)  # published: the checkpoint exists only once complete
        (root / "latest.tmp").write_text(final.name)  # for people; resume scans the folders
        os.replace(root / "latest.tmp", root / "latest")
        for old in step_dirs(run_dir)[keep:] if keep else []:
            shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


# -- find and load ----------------------------------------------------------------------------------------------
def verify(path: Path) -> str | None:
    """None when the checkpoint is complete and every file matches its checksum; else what is wrong, naming the
    file."""
    manifest = path / MANIFEST
    try:
        files = json.loads(manifest.read_text())["files"]
    except FileNotFoundError:
        return f"{manifest}: missing (incomplete checkpoint)"
    except (ValueError, KeyError, TypeError) as e:
        return f"{manifest}: unreadable ({e})"
    for required in ("state.json", "dcp/.metadata", "rng_rank0.json", "adapter/adapter_model.safetensors"):
        if required not in files:
            return f"{manifest}: does not list {required}"
    for name, digest in files.items():
        f = path / name
        if not f.is_file():
            return f"{f}: missing"
        if _sha256(f) != digest:
            return f"{f}: checksum mismatch ({f.stat().st_size} bytes; truncated or changed)"
    return None


def newest_valid(run_dir: Path) -> tuple[Path | None, list[str]]:
    """(the newest valid checkpoint or None when the run has none, what was wrong with each newer one). Raises one
    CheckpointError when checkpoints exist but none is valid."""
    problems = []
    for path in step_dirs(run_dir):
        problem = verify(path)
        if problem is None:
            return path, problems
        problems.append(problem)
    if problems:
        raise CheckpointError(f"no valid checkpoint in {Path(run_dir) / 'checkpoints'}: " + "; ".join(problems))
    return None, []


def load(path: Path, *, model, optimizer, scheduler, cursor, rank: int = 0, world: int = 1) -> dict:
    """Restore the run state of a verified checkpoint (a collective under torchrun); returns state.json."""
    state = json.loads((path / "state.json").read_text())
    if state.get("world", 1) != world:
        raise CheckpointError(f"trainer.resume: {path} was written by {state.get('world', 1)} rank(s), this run has "
                              f"{world}: the prompt split and the RNG states would differ; use the same world size")
    reader = _Reader(path / "dcp")
    try:  # here first, so an index that is not DCP's fails with one error naming it (dcp.load wraps it per rank)
        saved = set(reader.read_metadata().state_dict_metadata)
    except (pickle.UnpicklingError, CheckpointError) as e:
        raise CheckpointError(f"{path / 'dcp' / '.metadata'}: {e}") from None
    lora = _lora_state(model)
    if missing := sorted(k for k in lora if f"model.{k}" not in saved):
        raise CheckpointError(f"{path}: no saved values for LoRA parameters {missing[:5]}: another model.lora config?")
    # Parameters that never had a gradient (the indexer's LoRA) have no optimizer state: they get none here either
    optim = {fqn: s for fqn, s in _optimizer_tensors(model, optimizer).items()
             if all(f"optim.{fqn}.{k}" in saved for k in s)}
    target = {"model": lora, "optim": optim}
    dcp.load(target, storage_reader=reader, no_dist=world == 1)  # in place into the parameters' (shards') storage
    full = get_optimizer_state_dict(model, optimizer)
    for group, saved in zip(full["param_groups"], state["param_groups"]):
        group.update({k: v for k, v in saved.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
    set_optimizer_state_dict(model, optimizer, {"state": optim, "param_groups": full["param_groups"]},
                             options=StateDictOptions(strict=False))  # strict would want the stateless ones too
    for fqn, p in model.named_parameters():
        if p.requires_grad and fqn not in optim:
            optimizer.state.pop(p, None)  # as in the run that saved it (a state here would change Adam's step count)
    scheduler.load_state_dict(state["scheduler"])
    cursor.load_state_dict(state["cursor"])
    set_rng_state(json.loads((path / f"rng_rank{rank}.json").read_text()))
    return state
