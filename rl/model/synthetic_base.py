"""A served MiniMax-M3 checkpoint that exists only in memory: random weights, drawn when asked for, in the served
formats (NVFP4 routed experts with w1/w3 sharing a global scale, MXFP8 projections, the rest bf16/fp32).

For trainer runs at real width and depth without a 250 GB file: `BaseWeights(SyntheticCheckpoint(cfg, "cuda"),
...)` builds the trainer model directly on the GPU, one tensor at a time (an expert's bf16 draw is quantized at
once and dropped, so no bf16 copy of the experts ever exists). Shapes, init scales and which tensors are fp32 come
from `m3.weights.weight_specs`, the quantization plan from `quant.convert.plan` (what
scripts/quantize_checkpoint.py writes); every value is a function of (seed, tensor name, device type).
"""

from __future__ import annotations

import hashlib

import torch

from m3.weights import weight_specs
from quant import convert
from quant.checkpoint import MXFP8Weight, NVFP4Weight, nvfp4_global_scale, quantize_mxfp8, quantize_nvfp4


class SyntheticCheckpoint:
    """The `QuantizedCheckpoint` reading interface (`tensor`, `read`, `dequantized`) over random weights."""

    path = "<synthetic>"

    def __init__(self, text_config: dict, device: str | torch.device = "cpu", seed: int = 0):
        self.specs = weight_specs(text_config)
        self.device, self.seed = torch.device(device), seed
        self._w13_scale: dict[str, torch.Tensor] = {}  # expert prefix -> shared global scale of w1/w3

    def _draw(self, name: str) -> torch.Tensor:
        if name not in self.specs:
            raise KeyError(f"{name}: not a tensor of this model")
        shape, std, fp32 = self.specs[name]
        digest = hashlib.sha256(f"{self.seed}/{name}".encode()).digest()
        gen = torch.Generator(self.device).manual_seed(int.from_bytes(digest[:8], "little") >> 1)
        w = torch.randn(shape, generator=gen, device=self.device) * std
        return w if fp32 else w.to(torch.bfloat16)

    def tensor(self, name: str) -> torch.Tensor:
        return self._draw(name)

    def read(self, prefix: str) -> NVFP4Weight | MXFP8Weight | torch.Tensor:
        algo = convert.plan(prefix)
        w = self._draw(f"{prefix}.weight")
        if algo is None:
            return w
        if algo == convert.LINEAR_ALGO:
            return quantize_mxfp8(w.float(), name=prefix)
        expert, proj = prefix.rsplit(".", 1)
        gs = None
        if proj in ("w1", "w3"):  # vLLM serves the fused w13 with one global scale
            if expert not in self._w13_scale:
                self._w13_scale = {expert: nvfp4_global_scale(*(self._draw(f"{expert}.{p}.weight")
                                                                for p in ("w1", "w3")))}
            gs = self._w13_scale[expert]
        return quantize_nvfp4(w.float(), gs, name=prefix)

    def dequantized(self, prefix: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        w = self.read(prefix)
        return w if isinstance(w, torch.Tensor) else w.dequantize(dtype)
