"""The trainer's frozen base weights, read from the served checkpoint in the form the engine serves them.

`base="quantized"`: routed experts NVFP4 (packed, never a bf16 copy of all experts), every other projection MXFP8,
computed in the serving form of the profile (`quant.serving`). A bf16 checkpoint is quantized on load with the
same conventions as scripts/quantize_checkpoint.py. `base="bf16"`: plain frozen weights (for comparisons).
Router, norms, embeddings and lm_head stay as stored. Everything here is a buffer or a frozen parameter.
"""

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLRMSNorm

from quant.checkpoint import (
    MXFP8Weight,
    NVFP4Weight,
    QuantizedCheckpoint,
    nvfp4_global_scale,
    quantize_mxfp8,
    quantize_nvfp4,
)
from quant.serving import MXFP8Linear, marlin_flush_scales, nvfp4_linear
from rl.model.lora import LoRAConfig, LoRALinear


class DenseLinear(nn.Module):
    """A frozen unquantized linear (the bf16-base comparison, and unquantized checkpoints served as such)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.register_buffer("weight", weight)

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype))


class ExpertWeights(nn.Module):
    """All routed experts of one MoE layer: w13 = [gate; up] rows (vLLM's fused layout) and w2."""

    def __init__(self, w13, w2, dtype, profile="hopper"):
        super().__init__()
        self.dtype, self.profile, self.quantized = dtype, profile, isinstance(w13, tuple)
        if self.quantized:  # (packed [E, N, K/2], scale [E, N, K/16], global scale [E])
            for name, (packed, scale, gs) in (("w13", w13), ("w2", w2)):
                self.register_buffer(f"{name}_packed", packed)
                self.register_buffer(f"{name}_scale", scale)
                self.register_buffer(f"{name}_gs", gs)
        else:
            self.register_buffer("w13", w13)
            self.register_buffer("w2", w2)

    def _expert_linear(self, name: str, x: torch.Tensor, e: int) -> torch.Tensor:
        if not self.quantized:
            return F.linear(x, getattr(self, name)[e].to(x.dtype))
        return nvfp4_linear(x, self.packed(name)[e], getattr(self, f"{name}_scale")[e],
                            getattr(self, f"{name}_gs")[e], self.profile, dtype=self.dtype)

    def packed(self, name: str) -> torch.Tensor:
        """The packed NVFP4 codes of "w13" / "w2" as uint8 (rl.model.fsdp may hold them in a 1-byte float container)."""
        return getattr(self, f"{name}_packed").view(torch.uint8)

    def gate_up(self, x, e: int):
        return self._expert_linear("w13", x, e)

    def down(self, x, e: int):
        return self._expert_linear("w2", x, e)


class BaseWeights:
    """Builds the frozen modules of the trainer model from one checkpoint directory."""

    def __init__(self, ckpt, dtype, base: str, profile: str, marlin_flush: bool, text_config: dict | None = None):
        """ckpt: a QuantizedCheckpoint, or anything with its tensor/read/dequantized methods
        (rl.model.synthetic_base.SyntheticCheckpoint); text_config defaults to the checkpoint's config.json."""
        self.ckpt, self.dtype, self.base, self.profile, self.marlin_flush = ckpt, dtype, base, profile, marlin_flush
        if text_config is None:
            cfg = json.loads((Path(ckpt.path) / "config.json").read_text())
            text_config = cfg.get("text_config", cfg)
        self.text_config = text_config

    @classmethod
    def open(cls, path, dtype, base="quantized", profile="hopper", marlin_flush=False) -> "BaseWeights":
        if not (Path(path) / "config.json").is_file():
            raise FileNotFoundError(f"model.path: no checkpoint (config.json) at {path}")
        return cls(QuantizedCheckpoint(path), dtype, base, profile, marlin_flush)

    def tensor(self, name: str) -> torch.Tensor:
        return self.ckpt.tensor(name)

    def norm(self, prefix: str, eps: float) -> MiniMaxM3VLRMSNorm:
        weight = self.tensor(f"{prefix}.weight").to(self.dtype)
        norm = MiniMaxM3VLRMSNorm(weight.shape[0], eps)
        norm.weight = nn.Parameter(weight, requires_grad=False)
        return norm

    def _mxfp8(self, prefix: str) -> MXFP8Weight:
        w = self.ckpt.read(prefix)
        if isinstance(w, NVFP4Weight):
            raise ValueError(f"{prefix}: stored as NVFP4, but the engine serves this projection as MXFP8")
        return w if isinstance(w, MXFP8Weight) else quantize_mxfp8(w.float(), name=prefix)

    def _base_linear(self, prefixes: list[str]) -> tuple[nn.Module, int, int]:
        if self.base == "bf16":
            w = torch.cat([self.ckpt.dequantized(p, self.dtype) for p in prefixes]).to(self.dtype)
            return DenseLinear(w), w.shape[1], w.shape[0]
        parts = [self._mxfp8(p) for p in prefixes]  # MXFP8 blocks run along K: row-concatenation is exact
        w, s = torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts])
        return MXFP8Linear(w, s, profile=self.profile, dtype=self.dtype), w.shape[1], w.shape[0]

    def linear(self, prefix: str, lora: LoRAConfig | None, name: str | None = None) -> nn.Module:
        return self.fused_linear(name or prefix, [prefix], lora)

    def fused_linear(self, name: str, prefixes: list[str], lora: LoRAConfig | None) -> nn.Module:
        base, n_in, n_out = self._base_linear(prefixes)
        return LoRALinear(base, n_in, n_out, lora) if lora is not None else base

    def _nvfp4_expert(self, prefix: str, e: int) -> tuple[NVFP4Weight, NVFP4Weight]:
        """(w13, w2) of one expert; w13's global scale is the gate's, as vLLM serves the fused w13."""
        w1, w3, w2 = (self.ckpt.read(f"{prefix}.{e}.{w}") for w in ("w1", "w3", "w2"))
        if isinstance(w1, torch.Tensor):  # bf16 checkpoint: quantize as scripts/quantize_checkpoint.py does
            gs = nvfp4_global_scale(w1, w3)
            w1, w3 = quantize_nvfp4(w1.float(), gs), quantize_nvfp4(w3.float(), gs)
            w2 = quantize_nvfp4(w2.float())
        w13 = NVFP4Weight(torch.cat([w1.packed, w3.packed]), torch.cat([w1.scale, w3.scale]), w1.global_scale)
        return w13, w2

    def experts(self, prefix: str, num_experts: int) -> ExpertWeights:
        if self.base == "bf16":
            w13 = torch.stack([torch.cat([self.ckpt.dequantized(f"{prefix}.{e}.{w}", self.dtype)
                                          for w in ("w1", "w3")]) for e in range(num_experts)]).to(self.dtype)
            w2 = torch.stack([self.ckpt.dequantized(f"{prefix}.{e}.w2", self.dtype)
                              for e in range(num_experts)]).to(self.dtype)
            return ExpertWeights(w13, w2, self.dtype, self.profile)
        if self.profile == "blackwell":
            raise ValueError("model.profile='blackwell' needs the experts' static input scales (W4A4 NVFP4); this "
                             "checkpoint declares W4A16 experts. Use profile 'hopper'.")
        pairs = [self._nvfp4_expert(prefix, e) for e in range(num_experts)]

        def stack(i):
            packed = torch.stack([p[i].packed for p in pairs])
            scale = torch.stack([p[i].scale for p in pairs])
            if self.marlin_flush:  # Marlin's scale_factor is shared by the whole w13 (or w2) stack
                scale = marlin_flush_scales(scale, self.dtype)
            return packed, scale, torch.stack([p[i].global_scale.reshape(()) for p in pairs])

        return ExpertWeights(stack(0), stack(1), self.dtype, self.profile)
