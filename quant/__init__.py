"""Quantized-format codecs and serving forms shared by the trainer and the rollout checks.

Modules: ``nvfp4`` (NVFP4 weights/activations), ``mxfp8`` (MXFP8), ``kv_cache`` (NVFP4 KV-cache
fake-quant) and ``serving`` (the GEMM forms vLLM runs per hardware profile). Torch only: vLLM is
not imported here, because the trainer runs on machines without it.
"""
