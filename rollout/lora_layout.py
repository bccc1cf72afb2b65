"""Where each adapter tensor sits in vLLM's LoRA buffers, read from both ends for the installed == held check.

The trainer holds the adapter as peft tensors; a vLLM worker holds it as slices of its LoRA wrappers' stacked
buffers (`lora_a_stacked` / `lora_b_stacked` per output slice; `w13_*` / `w2_*` [experts, ...] for routed experts),
with B pre-multiplied by alpha/r in the LoRA dtype. `expected_slots` builds what those slices must hold from the
peft tensors with this module's own mapping (not vLLM's packing code); `installed_slots` reads them back from a
worker. Keys are `vllm_module|buffer|slice`. No vLLM import: the worker side only reads attributes.

Under tensor parallelism each worker holds its shard (`TPShard`), cut the way vLLM's LoRA wrappers cut it
(`slice_lora_a` / `slice_lora_b` in vllm/lora/layers, not fully sharded): column-parallel layers split B's output
rows (q over all ranks; k, v and the indexer's q follow the KV heads, replicated past their count; the indexer's
single k head is replicated; gate_up splits each half), row-parallel layers (o, down) split A's input columns,
routed experts split gate_up B's halves and down A's columns over the intermediate size, or with expert
parallelism hold their rank's block of whole experts.
"""

import ctypes
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

# The sparse layers' fused projection packs 5 shards; dense layers' qkv the first 3.
QKV_SHARDS = ["q_proj", "k_proj", "v_proj", "index_q_proj", "index_k_proj"]
LORA_PACKED_MODULES = {"qkv_proj": QKV_SHARDS, "gate_up_proj": ["gate_up_proj"]}
# transformers/peft names -> vLLM module names (reverse of transformers' minimax_m3_vl checkpoint conversion).
PEFT_TO_VLLM_SUBSTR = {
    ".self_attn.indexer.q_proj.": ".self_attn.index_q_proj.",
    ".self_attn.indexer.k_proj.": ".self_attn.index_k_proj.",
    ".mlp.experts.": ".block_sparse_moe.experts.",
    ".mlp.shared_experts.": ".block_sparse_moe.shared_experts.",
    ".mlp.gate.": ".block_sparse_moe.gate.",
}
PEFT_PREFIX = "base_model.model."
_VL_PREFIX = "language_model."  # the VL wrapper's text model; keys use the text model's names
_LINEAR = ("lora_a_stacked", "lora_b_stacked")
_EXPERTS = ("w13_lora_a_stacked", "w13_lora_b_stacked", "w2_lora_a_stacked", "w2_lora_b_stacked")


@dataclass(frozen=True)
class TPShard:
    """Which tensor-parallel shard one worker holds: its rank, the group size, the model's KV heads (the k/v
    slices' replication) and whether routed experts are split by expert (vLLM's enable_expert_parallel)."""
    rank: int = 0
    size: int = 1
    kv_heads: int = 1
    expert_parallel: bool = False


def _chunk(t: torch.Tensor, dim: int, pieces: int, index: int) -> torch.Tensor:
    return t.narrow(dim, index * (t.shape[dim] // pieces), t.shape[dim] // pieces)


def _halves_chunk(t: torch.Tensor, dim: int, tp: TPShard) -> torch.Tensor:
    """A fused [gate | up] dimension: each half split over the ranks, this rank's pieces concatenated."""
    gate, up = t.chunk(2, dim)
    return torch.cat([_chunk(gate, dim, tp.size, tp.rank), _chunk(up, dim, tp.size, tp.rank)], dim)


def shard(key: str, t: torch.Tensor, tp: TPShard) -> torch.Tensor:
    """This rank's part of one full buffer slice (`expected_slots` key and value)."""
    if tp.size == 1:
        return t
    module, buf, index = key.split("|")
    proj, index = module.rsplit(".", 1)[1], int(index)
    if buf.startswith(("w13_", "w2_")):  # [E, out, r] (B) / [E, r, in] (A)
        if tp.expert_parallel:
            return _chunk(t, 0, tp.size, tp.rank)
        if buf == "w13_lora_b_stacked":
            return _halves_chunk(t, 1, tp)
        return _chunk(t, 2, tp.size, tp.rank) if buf == "w2_lora_a_stacked" else t
    if proj in ("o_proj", "down_proj"):  # row parallel: A [r, in] by input columns
        return _chunk(t, 1, tp.size, tp.rank) if buf == "lora_a_stacked" else t
    if buf == "lora_a_stacked":  # column parallel: A whole
        return t
    if proj == "gate_up_proj":
        return _halves_chunk(t, 0, tp)
    if proj == "qkv_proj":  # [q, k, v, index_q, index_k]
        pieces = (tp.size, min(tp.size, tp.kv_heads), min(tp.size, tp.kv_heads), min(tp.size, tp.kv_heads), 1)[index]
        return _chunk(t, 0, pieces, tp.rank * pieces // tp.size)
    return _chunk(t, 0, tp.size, tp.rank)


def _vllm_module(path: str) -> str:
    path = f"{path}."
    for old, new in PEFT_TO_VLLM_SUBSTR.items():
        path = path.replace(old, new)
    return path[:-1]


@lru_cache(maxsize=None)
def _slot_of(name: str) -> tuple[str, bool, bool]:
    """peft tensor name -> (buffer key, is B, is a routed-experts 3D tensor); names repeat every sync."""
    path, kind = name.removeprefix(PEFT_PREFIX).rsplit(".lora_", 1)
    is_b = kind == "B.weight"
    if path.endswith(".mlp.experts.base_layer") or path.endswith(".mlp.experts"):
        gate_up = path.endswith(".base_layer")
        module = _vllm_module(path.removesuffix(".base_layer"))
        return f"{module}|{'w13' if gate_up else 'w2'}_lora_{'b' if is_b else 'a'}_stacked|0", is_b, True
    module, shard = _vllm_module(path).rsplit(".", 1)
    packed = next(((p, s.index(shard)) for p, s in LORA_PACKED_MODULES.items() if shard in s), None)
    name_, index = (f"{module}.{packed[0]}", packed[1]) if packed else (f"{module}.{shard}", 0)
    return f"{name_}|lora_{'b' if is_b else 'a'}_stacked|{index}", is_b, False


def expected_slots(peft: dict[str, torch.Tensor], rank: int, scaling: float, dtype: torch.dtype,
                   tp: TPShard = TPShard()) -> dict[str, torch.Tensor]:
    """What each buffer slice of the worker holding shard `tp` must hold for these peft tensors: A as given,
    B * scaling, both in the LoRA dtype (vLLM loads the tensors in that dtype, then scales B in place)."""
    out = {}
    for name, t in peft.items():
        key, is_b, experts = _slot_of(name)
        t = t.detach().to(dtype)
        if is_b:
            t = t * scaling
        if experts:  # peft's 3D format: A [E*r, in] expert-major rows; B [out, r*E] with the expert index fastest
            t = t.reshape(t.shape[0], rank, -1).permute(2, 0, 1) if is_b else t.reshape(-1, rank, t.shape[1])
        out[key] = shard(key, t, tp)
    return out


def _read_slots(adapter_manager, slot: int, rank: int | None) -> tuple[dict[str, torch.Tensor], list[tuple]]:
    """The views of `slot` in every LoRA buffer, trimmed to `rank` (None: whole, up to the engine's max rank), and
    (module, attr, index, buffer) for each buffer they view."""
    out, sources = {}, []
    for name in sorted(adapter_manager.modules):
        module, key = adapter_manager.modules[name], name.removeprefix(_VL_PREFIX)
        if hasattr(module, "w13_lora_a_stacked"):  # routed experts (its lora_*_stacked are views of these)
            for attr in _EXPERTS:
                for i, stacked in enumerate(getattr(module, attr)):  # one each for M3's 3D experts
                    buf = stacked[slot]  # [E, r, in] (A) or [E, out, r] (B)
                    out[f"{key}|{attr}|{i}"] = buf[:, :rank] if "_a_" in attr else buf[..., :rank]
                    sources.append((module, attr, i, stacked))
            continue
        for attr in _LINEAR:
            for i, stacked in enumerate(getattr(module, attr, None) or ()):
                b = stacked[slot, 0]  # A [r, in], B [out, r]
                out[f"{key}|{attr}|{i}"] = b[:rank] if attr == "lora_a_stacked" else b[:, :rank]
                sources.append((module, attr, i, stacked))
    return out, sources


def installed_slots(adapter_manager, lora_id: int, rank: int | None = None) -> dict[str, torch.Tensor]:
    """The slices of every LoRA buffer this worker holds for `lora_id`, trimmed to the adapter's rank (None: whole)."""
    return _read_slots(adapter_manager, adapter_manager.lora_index_to_id.index(lora_id), rank)[0]


class InstalledSlots:
    """`installed_slots` for a worker that checks every sync: the views are built once and reused while every
    buffer they view is still the one its module holds (a view reads the bytes when compared, so a reused view
    sees what is installed now). Building them costs ~6 us of Python per slice, a third of the check."""

    def __init__(self):
        self._key, self._views, self._sources = None, {}, []

    def __call__(self, adapter_manager, lora_id: int, rank: int) -> dict[str, torch.Tensor]:
        key = (id(adapter_manager), adapter_manager.lora_index_to_id.index(lora_id), rank,
               len(adapter_manager.modules))
        if key != self._key or any(getattr(m, attr)[i] is not buf for m, attr, i, buf in self._sources):
            self._views, self._sources = _read_slots(adapter_manager, key[1], rank)
            self._key = key
        return self._views


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


_libc = ctypes.CDLL(None)
_libc.memcmp.restype, _libc.memcmp.argtypes = ctypes.c_int, (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit patterns equal (-0.0 != 0.0; a NaN equals the same NaN). Contiguous CPU tensors: memcmp over their bytes
    (no copy, ~1 us of Python: the check runs every sync over every slice); else numpy (torch.equal is 3x slower)."""
    if a.device.type == "cpu" and a.is_contiguous() and b.is_contiguous() and a.nbytes == b.nbytes:
        return a.nbytes == 0 or _libc.memcmp(a.data_ptr(), b.data_ptr(), a.nbytes) == 0
    a, b = a.view(_SAME_SIZE_INT[a.element_size()]), b.view(_SAME_SIZE_INT[b.element_size()])
    if a.device.type == "cpu":
        return bool(np.array_equal(a.numpy(), b.numpy()))
    return torch.equal(a, b)


def mismatches(expected: dict[str, torch.Tensor], installed: dict[str, torch.Tensor]) -> list[str]:
    """Every buffer slice where the two differ (bitwise), by vLLM module; slices the adapter does not set must be
    zero (vLLM resets a slot before installing)."""
    out = []
    for key in sorted(expected.keys() | installed.keys()):
        want, got = expected.get(key), installed.get(key)
        if got is None:
            out.append(f"{key}: the engine has no such LoRA buffer")
        elif want is None:
            if got.count_nonzero():
                out.append(f"{key}: nonzero in the engine, absent from the trainer's adapter")
        elif want.shape != got.shape:
            out.append(f"{key}: shape {tuple(got.shape)} in the engine, {tuple(want.shape)} in the trainer")
        elif not _bitwise_equal(want := want.to(got.device, got.dtype), got):
            as_int = _SAME_SIZE_INT[got.element_size()]
            n = int((want.view(as_int) != got.view(as_int)).sum())  # bit patterns: -0.0 vs 0.0 counts
            diff = (want.float() - got.float()).abs()
            out.append(f"{key}: {n} values differ (max |d| {float(diff.max()):.3g})")
    return out
