"""Quantized-format codecs and serving forms shared by the trainer and the rollout checks.

Modules: ``nvfp4`` (NVFP4 weights/activations), ``mxfp8`` (MXFP8), ``kv_cache`` (NVFP4 KV-cache
fake-quant), ``serving`` (the GEMM forms vLLM runs per hardware profile) and ``checkpoint`` (lazy
reading and sharded writing of ModelOpt NVFP4 / MXFP8 / mixed-precision checkpoints). Torch (and
safetensors) only: vLLM is not imported here, because the trainer runs on machines without it.
"""
