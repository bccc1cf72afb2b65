"""FSDP2 for the LoRA trainer: shard the trainable adapter (and the frozen float tensors) over data-parallel ranks.

What FSDP2 (`fully_shard`, torch 2.13) does with each kind of tensor of `M3ForTraining`:
- LoRA parameters (fp32 masters): sharded on dim 0, all-gathered per decoder layer in forward/backward, gradients
  reduce-scattered (averaged over ranks, like DDP). With a mixed-precision policy they are all-gathered in its
  `param_dtype` and their gradients reduced in fp32.
- Frozen float parameters (embeddings, lm_head, norms): sharded too (frozen parameters are managed like trainable
  ones, just without gradients), and cast to `param_dtype` if it differs from their dtype. `shard_model` refuses
  a policy that would change them: the forward must stay the served model's.
- Buffers: never sharded, never cast, only moved to the mesh device. The quantized base (NVFP4 packed uint8 +
  E4M3 scales, MXFP8 E4M3 + E8M0, fp32 global scales, the fp32 router) is all buffers (rl/model/quantized_base.py),
  so by default it is replicated on every rank exactly as stored (fine for models that fit one GPU).
- `shard_base=True` (full-size M3: ~250 GB of NVFP4 experts) turns the base's weight tensors into frozen
  parameters, which FSDP2 shards on dim 0 (experts / output rows) and all-gathers per layer as raw bytes, so each
  rank holds 1/world of the base plus one or two gathered layers. Why not expert parallelism: at RL batch sizes
  (>= 16K tokens per rank) a layer's expert GEMMs take far longer than gathering its ~4 GB of packed experts over
  NVLink, and FSDP keeps LoRA, sharding and checkpointing identical for every module.
- A frozen *parameter* holding packed bytes would be mishandled: torch skips the cast only for non-floating dtypes,
  and float8 counts as floating, so an E4M3 tensor would be all-gathered as bf16. `shard_model` turns every frozen
  parameter that is not bf16/fp16/fp32/fp64 into a buffer of its module before sharding.

`M3ForTraining` has no `forward`; FSDP2's root hooks fire only on `forward`, so `token_logprobs` is registered as
the root's forward method (call `hidden_states` only through it, e.g. `token_logprobs(..., stats=...)`).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from m3.config import DTYPES
from quant.serving import MXFP8Linear
from rl.model.lora import ExpertLoRA, LoRALinear, adapter_state_dict
from rl.model.quantized_base import DenseLinear, ExpertWeights

_COMPUTE_DTYPES = (torch.float64, torch.float32, torch.bfloat16, torch.float16)


class DistInfo(NamedTuple):
    rank: int
    world_size: int
    local_rank: int
    device: torch.device


def init_distributed(backend: str | None = None, timeout_s: float = 600.0) -> DistInfo:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    nccl when CUDA is available, gloo otherwise. World size 1 (or no torchrun env) initializes nothing, so single
    process code paths keep working without a store. Idempotent: an existing group is reused.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", str(rank)))
    cuda = torch.cuda.is_available() and backend != "gloo"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if dist.is_initialized():
        return DistInfo(dist.get_rank(), dist.get_world_size(), local, device)
    if world > 1:
        dist.init_process_group(backend or ("nccl" if cuda else "gloo"), rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s), device_id=device if cuda else None)
    return DistInfo(rank, world, local, device)


def default_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    device_type = "cuda" if "nccl" in str(dist.get_backend()) else "cpu"
    return init_device_mesh(device_type, (dist.get_world_size(),))


def _mp_policy(mixed_precision: str | None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    # The model already chooses its activation dtypes as vLLM does (fp32 router, fp32 norm sums, ...): FSDP must
    # not cast forward inputs behind its back.
    if mixed_precision is None:
        return MixedPrecisionPolicy(cast_forward_inputs=False), None
    if mixed_precision not in DTYPES:
        raise ValueError(f"mixed_precision={mixed_precision!r}: expected None or one of {sorted(DTYPES)}")
    dtype = DTYPES[mixed_precision]
    # fp32 gradient reduction: summing bf16 partial gradients over ranks would round each rank's share.
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32, cast_forward_inputs=False), dtype


def frozen_params_to_buffers(model: nn.Module) -> list[str]:
    """Re-register frozen parameters of non-compute dtypes (uint8 codes, float8 values/scales) as buffers, so
    FSDP2 neither shards them nor casts them to the mixed-precision dtype. Returns their names."""
    from torch.distributed.tensor import DTensor

    moved = []
    for mod_name, module in model.named_modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.requires_grad or p.dtype in _COMPUTE_DTYPES or isinstance(p, DTensor):  # DTensor: sharded on purpose
                continue
            del module._parameters[name]
            module.register_buffer(name, p.detach())
            moved.append(f"{mod_name}.{name}" if mod_name else name)
    return moved


# FSDP2 in torch 2.11 builds each sharded parameter as nn.Parameter(shard) (requires_grad=True) before restoring
# the flag, which integer dtypes refuse; packed uint8 bytes (NVFP4 codes, E8M0 scales) therefore travel as this
# 1-byte float dtype, bit for bit, never computed with: the modules view them back to uint8 at use.
BYTE_CONTAINER = torch.float8_e4m3fn


def _keep_requires_grad(module: nn.Module, shard):
    """Run `shard(module)` and restore every parameter's requires_grad afterwards (FSDP2 re-creates them)."""
    flags = {n: p.requires_grad for n, p in module.named_parameters()}
    out = shard(module)
    for n, p in module.named_parameters():
        p.requires_grad_(flags.get(n, p.requires_grad))
    return out


def base_to_params(module: nn.Module) -> list[str]:
    """Re-register the frozen base's weight tensors (NVFP4 packed bytes and E4M3 scales of the experts, MXFP8 E4M3
    weights and E8M0 scales, the bf16 base's weights) as frozen parameters, so `fully_shard` shards them on dim 0
    and all-gathers them per layer (as raw bytes: FSDP2 gathers a group of mixed dtypes as uint8) instead of
    replicating them. Only without a mixed-precision policy, which would cast float8 tensors. Returns the names."""
    moved = []
    for mod_name, mod in module.named_modules():
        if not isinstance(mod, (ExpertWeights, MXFP8Linear, DenseLinear)):
            continue
        for name, b in list(mod.named_buffers(recurse=False)):
            if b is None or b.ndim < 2:  # per-expert global scales stay replicated buffers
                continue
            if b.dtype == torch.uint8:  # bit-for-bit view; the modules view it back (see BYTE_CONTAINER)
                b = b.view(BYTE_CONTAINER)
            del mod._buffers[name]
            mod.register_parameter(name, nn.Parameter(b, requires_grad=False))
            moved.append(f"{mod_name}.{name}" if mod_name else name)
    return moved


def shard_layer(layer: nn.Module, mesh, mixed_precision: str | None = None, reshard_after_forward: bool = True,
                shard_base: bool = False) -> nn.Module:
    """`fully_shard` one decoder layer (see `shard_model`); with `shard_base` its frozen base is sharded too."""
    from torch.distributed.fsdp import fully_shard

    policy, _ = _mp_policy(mixed_precision)
    if shard_base and mixed_precision is not None:
        raise ValueError("shard_base needs mixed_precision=None: a policy would cast the float8 base tensors")
    frozen_params_to_buffers(layer)
    if shard_base:
        base_to_params(layer)
    return _keep_requires_grad(layer, lambda m: fully_shard(m, mesh=mesh, mp_policy=policy,
                                                            reshard_after_forward=reshard_after_forward))


def shard_model(model: nn.Module, mesh=None, mixed_precision: str | None = None,
                reshard_after_forward: bool = True, shard_base: bool = False) -> nn.Module:
    """`fully_shard` each decoder layer (`model.model.layers`), then the root (embeddings, final norm, lm_head);
    register `token_logprobs` as the root forward. In place; returns `model`.

    mixed_precision: None keeps every tensor's dtype (fp32 LoRA masters stay fp32 in compute); "bfloat16" etc.
    all-gathers LoRA in that dtype (what vLLM serves the adapter in) and reduces gradients in fp32. It must equal the
    dtype of the frozen float parameters, which the policy would otherwise cast too.
    shard_base: shard the quantized base over the ranks as well (`base_to_params`); without it every rank holds
    the whole base. Layers already sharded (e.g. by `shard_layer` as M3ForTraining's `on_layer`) are kept.
    Without an initialized process group (world size 1) and no mesh this is a no-op: the model stays plain.
    """
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    if mesh is None:
        if not dist.is_initialized():
            return model
        mesh = default_mesh()
    policy, dtype = _mp_policy(mixed_precision)
    frozen_params_to_buffers(model)
    if dtype is not None:
        wrong = sorted({f"{n} ({p.dtype})" for n, p in model.named_parameters()
                        if not p.requires_grad and p.dtype != dtype})
        if wrong:
            raise ValueError(f"mixed_precision={mixed_precision!r} would cast frozen base parameters the served "
                             f"model keeps in another dtype, e.g. {wrong[:3]}; use None or the model dtype")
    for layer in model.model.layers:
        if not isinstance(layer, FSDPModule):
            shard_layer(layer, mesh, mixed_precision, reshard_after_forward, shard_base)
    _keep_requires_grad(model, lambda m: fully_shard(m, mesh=mesh, mp_policy=policy))
    if hasattr(model, "token_logprobs"):
        register_fsdp_forward_method(model, "token_logprobs")
    return model


def full_lora_tensors(model: nn.Module, grads: bool = False, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Full (unsharded) LoRA parameters, or their gradients, on CPU keyed by module FQN. A collective: every rank
    must call it. Gradients that do not exist (e.g. the indexer's, see rl/model/lora.py) are left out.

    Not `get_model_state_dict(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)`: it returns the
    same LoRA tensors, but also every buffer, i.e. it would copy the whole quantized base to rank 0's host memory on
    each call. This does what it does for the parameters (DTensor.full_tensor, then to CPU) for LoRA only, one
    tensor at a time, so the device never holds more than one gathered tensor.
    """
    from torch.distributed.tensor import DTensor

    rank = dist.get_rank() if dist.is_initialized() else 0
    out = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        t = p.grad if grads else p.detach()
        if t is None:
            continue
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if rank0_only and rank != 0:
            continue
        out[name] = t.detach().to("cpu", copy=True)
    return out


def full_adapter_state_dict(model: nn.Module, dtype: torch.dtype | None = None,
                            rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """Every LoRA tensor under its peft name (`rl.model.lora.adapter_state_dict` naming and layout), gathered to CPU on
    rank 0 (`rank0_only`; other ranks get {}) or on every rank. Works on sharded and plain models."""
    full = full_lora_tensors(model, rank0_only=rank0_only)
    if not full:
        return {}
    # adapter_state_dict owns the peft names and the 3-D expert layout; show it the gathered tensors in place of
    # the shards for the duration of the call.
    swapped = []
    try:
        for path, module in model.named_modules():
            if isinstance(module, (LoRALinear, ExpertLoRA)):
                for name, p in module.named_parameters(recurse=False):
                    swapped.append((module, name, p))
                    module._parameters[name] = full[f"{path}.{name}" if path else name]
        return adapter_state_dict(model, dtype)
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
