"""In-memory adapter sync into vLLM workers: no files, a checksum of what was installed, transactional swap.

Sender side (trainer / engine client): `pack_adapter(tensors)` -> safetensors bytes + `adapter_checksum(tensors)`.
Worker side: `AdapterSyncExtension` is vLLM's `worker_extension_cls`; its methods run in every worker through
`collective_rpc`. `m3_install_adapter` validates the adapter completely (rank, module names, every slice's shape
against the model) before touching the engine, swaps it in under a fixed id, and restores the previous adapter
if installing fails, so a bad adapter never leaves the engine without one. It then reads its LoRA buffer slices
back and compares them bitwise with what the received (= sent, by checksum) tensors must become there
(rollout.lora_layout): installed == held on every sync, in the same call, with nothing sent back.
"""

import hashlib
import time

import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from rollout.lora_layout import InstalledSlots, TPShard, expected_slots, installed_slots, mismatches

# The LoRA ranks vLLM serves (its `MaxLoRARanks`; tests/rollout compares the two). Here, not in engine.py, so that
# config validation can read it without importing vLLM.
SERVED_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


class AdapterError(ValueError):
    """The adapter does not fit the served model; the engine keeps serving the previous adapter."""


def adapter_checksum(tensors: dict[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, raw bytes) in name order: what the sender sent = what the worker received."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def check_finite(tensors: dict[str, torch.Tensor]) -> None:
    """NaN/Inf never reach the engine (a sum is NaN/Inf iff some element is, barring overflow, which is as bad)."""
    for name, t in tensors.items():
        if not torch.isfinite(t.detach().float().sum()):
            raise AdapterError(f"adapter tensor {name} has NaN/Inf values; refusing to send it to the engine")


def pack_adapter(tensors: dict[str, torch.Tensor]) -> bytes:
    """One safetensors blob: survives vLLM's multiprocess RPC (tensors inside args would arrive as lists)."""
    return save_safetensors({k: v.detach().contiguous().cpu() for k, v in tensors.items()})


def unpack_adapter(payload) -> dict[str, torch.Tensor]:
    """The worker's own copy: vLLM scales lora_B in place while packing, so never alias the sender's tensors."""
    if isinstance(payload, (bytes, bytearray, memoryview)):
        return load_safetensors(bytes(payload))
    return {k: v.detach().clone() for k, v in payload.items()}


def _shape_mismatches(lora, dummy, lora_modules) -> list[str]:
    """Compare every packed module of `lora` with vLLM's zero adapter of the same rank (its expected shapes). Under
    tensor parallelism the zero adapter has this rank's shard shapes and `lora` the full ones: each module's own
    slicing (the one activation applies) cuts `lora` first; routed experts are compared whole (tensor parallel: both
    full size) or as this rank's experts (expert parallel: packing already kept only those)."""
    errors = []
    for name, weights in lora.loras.items():
        if name not in lora_modules and not name.endswith(".base_layer"):
            errors.append(f"{name}: no such LoRA module in the served model")
            continue
        expected = dummy.loras.get(name)
        if expected is None:
            errors.append(f"{name}: the served model has no LoRA weights for this module")
            continue
        module = lora_modules.get(name.removesuffix(".base_layer"))
        sliced = getattr(module, "tp_size", 1) > 1 and ".experts" not in name
        for kind in ("lora_a", "lora_b"):
            got, want = getattr(weights, kind), getattr(expected, kind)
            if sliced:
                got = getattr(module, f"slice_{kind}")(got)
            got = got if isinstance(got, list) else [got]
            want = want if isinstance(want, list) else [want]
            if name.endswith(".experts"):  # [gate_up, down] 3D stacks vs the dummy's flat peft halves
                extra = getattr(dummy.loras.get(name + ".base_layer"), kind, None)
                want = want + ([extra] if extra is not None else [])
            if ".experts" in name:  # compare sizes: the layouts differ, the values per expert do not
                sizes_got = sum(g.numel() for g in got if g is not None)
                sizes_want = sum(w.numel() for w in want if w is not None)
                if sizes_got != sizes_want:
                    errors.append(f"{name}.{kind}: {sizes_got} values, the model expects {sizes_want}")
                continue
            for i, g in enumerate(got):
                w = want[i] if i < len(want) else None
                if g is None:
                    continue
                if w is None or tuple(g.shape) != tuple(w.shape):
                    errors.append(f"{name}.{kind}[{i}]: shape {tuple(g.shape)}, the model expects "
                                  f"{None if w is None else tuple(w.shape)}")
    return errors


def _unknown_or_incomplete(lora, adapter_manager) -> list[str]:
    """Module names the served model lacks (vLLM would silently ignore them) and half-present A/B pairs."""
    known = set(adapter_manager.modules)
    known |= {child for children in adapter_manager.packed_modules.values() for child in children}
    errors = []
    for name, weights in lora.loras.items():
        if name.removesuffix(".base_layer") not in known:
            errors.append(f"{name}: no such LoRA module in the served model")
        elif weights.lora_a is None or weights.lora_b is None:
            errors.append(f"{name}: has {'lora_B' if weights.lora_a is None else 'lora_A'} without its pair")
    return errors


def installed_checksum(adapter_manager, lora_id: int) -> str:
    """sha256 of the LoRA buffers this worker holds for `lora_id` (its slot of every wrapper's stacked weights)."""
    return adapter_checksum(installed_slots(adapter_manager, lora_id))


class AdapterSyncExtension:
    """vLLM worker extension (`LLM(worker_extension_cls="rollout.adapter_sync.AdapterSyncExtension")`)."""

    def m3_install_adapter(self, payload, peft_config: dict, lora_id: int, sender_checksum: str) -> dict:
        """`payload`: safetensors bytes (multiprocess engines) or the tensor dict itself (in-process engines)."""
        from vllm.lora.peft_helper import PEFTHelper

        t0 = time.perf_counter()
        tensors = unpack_adapter(payload)
        received = adapter_checksum(tensors)
        if received != sender_checksum:
            raise AdapterError(f"adapter corrupted in transit: sender checksum {sender_checksum[:16]}…, "
                               f"received {received[:16]}…")
        mgr = self.model_runner.lora_manager
        am = mgr._adapter_manager
        helper = PEFTHelper.from_dict(dict(peft_config))
        # What the slots must hold, by rollout.lora_layout's mapping (not vLLM's packing code), from the received
        # tensors (= the trainer's, by the checksum above), built before vLLM scales B in place.
        t_verify = time.perf_counter()
        rank = int(peft_config["r"])
        expected = expected_slots(tensors, rank, float(peft_config["lora_alpha"]) / rank, mgr.lora_config.lora_dtype,
                                  self._m3_tp_shard())
        verify_s = time.perf_counter() - t_verify
        try:
            helper.validate_legal(mgr.lora_config)
        except ValueError as e:
            raise AdapterError(f"adapter config rejected by the engine: {e}") from e
        model = am.model
        mapper = getattr(model, "hf_to_vllm_mapper", None)
        lora = mgr._lora_model_cls.from_lora_tensors(
            lora_model_id=lora_id, tensors=tensors, peft_helper=helper, device="cpu",
            dtype=mgr.lora_config.lora_dtype, model_vocab_size=mgr.vocab_size,
            weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
            skip_prefixes=getattr(model, "lora_skip_prefixes", None))
        lora.is_3d_lora_weight = bool(getattr(model, "is_3d_moe_weight", False))
        errors = _unknown_or_incomplete(lora, am)
        if errors:
            raise AdapterError("adapter does not fit the served model:\n  " + "\n  ".join(errors[:20]))
        try:
            am._validate_moe_lora_format(lora)
            am._create_merged_loras_inplace(lora)  # pack shards, scale B by alpha/r, stack experts
        except Exception as e:
            raise AdapterError(f"adapter does not fit the served model: {e}") from e
        errors = _shape_mismatches(lora, self._m3_expected_adapter(am, lora_id, helper.r), am.modules)
        if errors:
            raise AdapterError("adapter does not fit the served model:\n  " + "\n  ".join(errors[:20]))

        previous = am.get_adapter(lora_id)
        am.remove_adapter(lora_id)
        try:
            am._registered_adapters[lora_id] = lora  # already merged: register without re-packing
            am.activate_adapter(lora_id)
        except Exception:
            am.remove_adapter(lora_id)
            if previous is not None:
                am._registered_adapters[lora_id] = previous
                am.activate_adapter(lora_id)
            raise
        t_verify = time.perf_counter()
        installed = self.__dict__.setdefault("_m3_installed", InstalledSlots())(am, lora_id, rank)
        found = mismatches(expected, installed)  # installed == held, bitwise
        verify_s += time.perf_counter() - t_verify
        return {"received_checksum": received, "mismatches": found, "verify_ms": verify_s * 1e3,
                "install_ms": (time.perf_counter() - t0) * 1e3, "tp_rank": self._m3_tp_shard().rank}

    def _m3_tp_shard(self) -> TPShard:
        """The shard of the adapter this worker holds (its tensor-parallel rank in the engine)."""
        if "_m3_shard" not in self.__dict__:
            from vllm.distributed import parallel_state as ps  # where they are defined (the package star-imports them)

            self._m3_shard = TPShard(ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                                     self.model_runner.model_config.get_total_num_kv_heads(),
                                     bool(self.vllm_config.parallel_config.enable_expert_parallel))
        return self._m3_shard

    def m3_tp_shard(self) -> dict:
        return vars(self._m3_tp_shard())

    def _m3_expected_adapter(self, am, lora_id: int, rank: int):
        """vLLM's zero adapter of this rank: the shapes every module expects (built once per rank)."""
        cache = self.__dict__.setdefault("_m3_expected", {})
        if rank not in cache:
            cache[rank] = am.create_dummy_lora(lora_id, rank, {})
        return cache[rank]

    def m3_adapter_slots(self, lora_id: int, rank: int, as_bytes: bool):
        """This worker's LoRA buffer slices for `lora_id` (rollout.lora_layout keys); safetensors bytes across
        processes (tensors in an RPC reply would arrive as lists)."""
        slots = installed_slots(self.model_runner.lora_manager._adapter_manager, lora_id, rank)
        return pack_adapter(slots) if as_bytes else slots

    def m3_installed_checksum(self, lora_id: int) -> str:
        return installed_checksum(self.model_runner.lora_manager._adapter_manager, lora_id)
