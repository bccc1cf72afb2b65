"""The trainer's MiniMax-M3, holding the base exactly as the engine serves it. Imports no vLLM.

  transformer.py     the model: decoder layers in vLLM's op order and precision, token logprobs, replay
  options.py         its choices (dtype, base, serving profile, KV/indexer cache dtypes, MSA/MoE implementation)
  quantized_base.py  the frozen base: NVFP4 routed experts and MXFP8 projections in their serving forms
  lora.py            rank-r LoRA beside each base GEMM (vLLM's order), peft-format save/load
  routing_replay.py  MoE routing: the trainer's own top-k or the engine's captured choice
  msa.py             MiniMax Sparse Attention: block selection, replay checks, block-sparse attention (torch, flex)
  msa_triton.py      MSA's Triton kernels for the GPU
  lean.py            memory-lean autograd functions for the per-token fp32 math (norms, router, LM head logprobs)
  lean_triton.py, swiglu_triton.py, lm_head_triton.py  their Triton kernels on CUDA
  fsdp.py            FSDP2 sharding under torchrun, the full adapter state dict
  synthetic_base.py  a quantized M3-width base without a checkpoint, for GPU benchmarks
"""

from rl.model.transformer import ForwardStats, M3ForTraining, TrainerModelConfig

__all__ = ["ForwardStats", "M3ForTraining", "TrainerModelConfig"]
