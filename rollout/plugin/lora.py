"""LoRA for vLLM's MiniMax-M3 classes (vLLM 0.32/0.33 ship them without `SupportsLoRA`).

- Model subclasses registered under the built-in architecture names add `SupportsLoRA`, the packed-module map
  (the sparse layers' fused `qkv_proj` packs 5 shards `[q|k|v|index_q|index_k]`) and the peft-name mapper.
- Two LoRA layer wrappers for the qkv projections that vLLM's exact-type checks never wrap.
- Adapters follow transformers' `minimax_m3_vl` names as peft writes them: `self_attn.{q,k,v,o}_proj`,
  `self_attn.indexer.{q,k}_proj`, fused `mlp.gate_up_proj` / `mlp.shared_experts.gate_up_proj` (one A, B over
  both halves), `down_proj`, and routed experts in peft's 3D format (`mlp.experts.base_layer.lora_*` = gate_up,
  `mlp.experts.lora_*` = down) - the format our trainer saves.

Expert LoRA on GPUs: vLLM's `MarlinExperts` (W4A16 NVFP4, the backend LoRA forces on H200 and Blackwell) and
`TritonExperts` (bf16) apply it through Punica. On Blackwell, applying it *inside* the NVFP4 MoE kernel needs
FlashInfer TRT-LLM's `trtllm_fp4_block_scale_routed_moe(..., gemm1_lora_delta=...)` plus `moe_lora_delta`'s
`bgmv_moe_gemm{1,2}_lora_delta`; FlashInfer 0.7.2 accepts E2M1 weights only with E2M1 activations and returns
the FC1 activation quantized without scales, so no vLLM class exists for it. `M3RL_BLACKWELL_TRTLLM_MOE_LORA=1`
is the flag reserved for it; `blackwell_trtllm_moe_lora_requested()` refuses it with that reason (cannot be
run here: no SM100 machine).
"""

import os

from rollout.plugin.m3_import import ensure_m3_importable

ensure_m3_importable()

from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA  # noqa: E402
from vllm.lora.layers.column_parallel_linear import (  # noqa: E402
    MergedColumnParallelLinearWithLoRA,
    MergedQKVParallelLinearWithLoRA,
)
from vllm.model_executor.layers.linear import QKVParallelLinear  # noqa: E402
from vllm.model_executor.models.interfaces import SupportsLoRA  # noqa: E402
from vllm.model_executor.models.utils import WeightsMapper  # noqa: E402
from vllm.models.minimax_m3.nvidia.model import (  # noqa: E402
    MiniMaxM3SparseForCausalLM,
    MiniMaxM3SparseForConditionalGeneration,
)

from rollout.lora_layout import LORA_PACKED_MODULES, PEFT_TO_VLLM_SUBSTR, QKV_SHARDS  # noqa: E402

# The modules an adapter may target (vLLM `lora_target_modules` suffixes); the router gate is never adapted.
TARGET_MODULES = ["qkv_proj", "o_proj", "gate_up_proj", "down_proj", "experts"]


def blackwell_trtllm_moe_lora_requested() -> bool:
    if os.environ.get("M3RL_BLACKWELL_TRTLLM_MOE_LORA", "0") != "1":
        return False
    raise NotImplementedError(
        "expert LoRA inside the Blackwell NVFP4 TRT-LLM MoE kernel needs FlashInfer to accept BF16 activations with "
        "E2M1 weights (or return FC1 activation scales); FlashInfer 0.7.2 does neither. LoRA runs NVFP4 experts on "
        "Marlin W4A16 instead.")


class MiniMaxM3QKVIndexerWithLoRA(MergedColumnParallelLinearWithLoRA):
    """LoRA on the sparse layers' 5-shard `[q|k|v|index_q|index_k]` projection: one A/B per shard.

    Tensor parallel: q is split over ranks, k/v/index_q follow the KV heads (replicated when TP > KV heads),
    index_k is one head replicated on every rank."""

    def __init__(self, base_layer) -> None:
        super().__init__(base_layer)
        kv = self.tp_rank // base_layer.num_kv_head_replicas
        self.output_ids = (self.tp_rank, kv, kv, kv, 0)
        assert sum(self.output_slices) == base_layer.output_size_per_partition

    apply = BaseLinearLayerWithLoRA.apply  # plain GEMM + delta; the merged-column custom-forward probe is moot

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None,
                          decorate: bool = True) -> bool:  # vLLM's signature (its sharded subclasses pass decorate)
        return (type(source_layer).__name__ == "MinimaxM3QKVParallelLinearWithIndexer"
                and len(packed_modules_list) == 5 and not lora_config.fully_sharded_loras)


class MiniMaxM3DenseQKVWithLoRA(MergedQKVParallelLinearWithLoRA):
    """LoRA on the dense layers' `[q|k|v]` projection under the 5-name packed map (no index shards there)."""

    def set_lora(self, index, lora_a, lora_b):
        if isinstance(lora_b, list) and len(lora_b) == 5:
            if lora_b[3] is not None or lora_b[4] is not None:
                raise ValueError("adapter has indexer LoRA weights for a dense-attention layer")
            lora_a, lora_b = lora_a[:3], lora_b[:3]
        super().set_lora(index, lora_a, lora_b)

    @classmethod
    def can_replace_layer(cls, source_layer, lora_config, packed_modules_list, model_config=None,
                          decorate: bool = True) -> bool:  # vLLM's signature (its sharded subclasses pass decorate)
        return (type(source_layer) is QKVParallelLinear and packed_modules_list == QKV_SHARDS
                and not lora_config.fully_sharded_loras)


class _M3LoRA(SupportsLoRA):
    embedding_modules = {}
    is_3d_moe_weight = True  # routed experts: peft's 3D format
    lora_skip_prefixes = ["mtp."]

    def _enable_lora_names(self, vllm_config, prefix_map=None) -> None:
        # On the instance, only when LoRA is on: the class-level map feeds quantization exclude lists, which
        # must keep seeing the checkpoint's 3-shard qkv names.
        if vllm_config.lora_config is None:
            return
        blackwell_trtllm_moe_lora_requested()
        self.packed_modules_mapping = dict(LORA_PACKED_MODULES)
        mapper = WeightsMapper(orig_to_new_substr=dict(PEFT_TO_VLLM_SUBSTR), orig_to_new_prefix=prefix_map or {})
        base = getattr(type(self), "hf_to_vllm_mapper", None)
        self.hf_to_vllm_mapper = (base | mapper) if base is not None else mapper


class MiniMaxM3SparseForCausalLMWithLoRA(MiniMaxM3SparseForCausalLM, _M3LoRA):
    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        if not getattr(self.config, "architectures", None):
            self.config.architectures = ["MiniMaxM3SparseForCausalLM"]  # FusedMoE3DWithLoRA reads it
        self._enable_lora_names(vllm_config)


class MiniMaxM3SparseForConditionalGenerationWithLoRA(MiniMaxM3SparseForConditionalGeneration, _M3LoRA):
    """The VL wrapper: adapters address the text model; the vision tower is not adapted."""

    def __init__(self, *, vllm_config, prefix: str = ""):
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        self._enable_lora_names(vllm_config, prefix_map={
            "model.language_model.": "language_model.model.", "model.layers.": "language_model.model.layers.",
            "lm_head.": "language_model.lm_head."})

    def get_mm_mapping(self):
        from vllm.model_executor.models.module_mapping import MultiModelKeys

        return MultiModelKeys.from_string_field(language_model="language_model", tower_model="vision_tower.")
