"""Triton kernels for the H200 (sm90) serving forms of ``quant.forms`` ("hopper" profile).

- ``nvfp4_moe``: grouped GEMM over routed experts with packed NVFP4 weights, tokens sorted by expert,
  e2m1 * s decoded in registers, fp32 accumulation, the per-expert global scale on the accumulator
  (W4A16, what Humming/Marlin serve), plus the input-gradient kernel; ``nvfp4_moe_linear`` is the
  autograd entry point; from many rows per expert on it decodes the weights to bf16 once per call and runs
  cuBLAS with the global scale as alpha (``nvfp4_dequant``).
- ``grouped``: grouped GEMMs over expert-sorted rows (``torch._grouped_mm`` on sm90 bf16, a loop elsewhere), for
  the experts' LoRA.
- ``mxfp8_linear``: MXFP8 (W8A16) linear forward and input gradient, either dequant-fused Triton
  kernels or a one-pass dequantize into a bf16 buffer followed by cuBLAS.

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
