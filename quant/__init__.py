"""Quantized-format codecs and serving forms shared by the trainer and the rollout checks.

Modules, each depending only on those before it: ``nvfp4`` (NVFP4 weights/activations), ``mxfp8`` (MXFP8),
``kv_cache`` (NVFP4 KV-cache fake-quant), ``forms`` (the GEMM forms vLLM runs per hardware profile, pure torch),
``kernels`` (Triton fast paths of the "hopper" forms), ``serving`` (the frozen quantized linears, and the forms
re-exported), ``checkpoint`` (lazy reading and sharded writing of ModelOpt NVFP4 / MXFP8 / mixed-precision
checkpoints) and ``convert`` (a bf16 checkpoint to the served format). Torch (and safetensors) only: vLLM is not
imported here, because the trainer runs on machines without it.
"""
