"""Triton kernels for the H200 (sm90) serving forms of ``quant.forms`` ("hopper" profile).

- ``nvfp4_moe``: ``nvfp4_moe_linear``, the routed experts' NVFP4 linear (W4A16, what Humming/Marlin serve) as an
  autograd function over rows sorted by expert (``sort_by_expert``), choosing per call and direction between
- ``nvfp4_moe_gemm``: the fused grouped GEMM and its input gradient, e2m1 * s decoded in registers, fp32
  accumulation, the per-expert global scale on the accumulator (few rows per expert), and
- ``nvfp4_dequant``: the weights decoded to bf16 once per call, then cuBLAS with the global scale as alpha (many).
- ``grouped``: grouped GEMMs over expert-sorted rows (``torch._grouped_mm`` on sm90 bf16, a loop elsewhere), for
  the experts' LoRA.
- ``mxfp8_linear``: MXFP8 (W8A16) linear forward and input gradient, either dequant-fused Triton
  kernels or a one-pass dequantize into a bf16 buffer followed by cuBLAS.
- ``_triton``: ``triton_available``, the check every entry point makes before launching a kernel.

Importing this package imports only torch. Triton is imported lazily, the first time a kernel runs
on a CUDA tensor; every entry point falls back to the pure-torch ``quant.forms`` form on CPU (or
when Triton is missing), so CPU code paths never need Triton.
"""

from quant.kernels._triton import triton_available
from quant.kernels.mxfp8_linear import mxfp8_dequantize, mxfp8_linear
from quant.kernels.nvfp4_moe import expert_offsets, nvfp4_moe_linear, nvfp4_moe_linear_reference, sort_by_expert

__all__ = [
    "expert_offsets",
    "mxfp8_dequantize",
    "mxfp8_linear",
    "nvfp4_moe_linear",
    "nvfp4_moe_linear_reference",
    "sort_by_expert",
    "triton_available",
]
