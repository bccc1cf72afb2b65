"""Rank-r LoRA on the frozen (quantized) base, computed unmerged the way vLLM's LoRA layers compute it, saved and
loaded in peft's format with the exact names and shapes vLLM's loader accepts for MiniMax-M3.

vLLM adds `B(Ax)` beside the quantized base GEMM: the shrink `x @ A^T` accumulates in an fp32 buffer, the buffer is
cast to the activation dtype, and the expand uses B pre-scaled by alpha/r in the LoRA dtype (`lora_b *= scaling`
in `LoRALayerWeights.optimize`). The engine holds A and B in the model dtype (the adapter is synced in it), so the
trainer rounds its (fp32) masters to that dtype in the forward as well. We never fold the delta into the weight (peft does for MoE experts), which a
quantized base could not hold and which is not what the engine computes.

peft names (transformers' minimax_m3_vl module paths, `base_model.model.` prefix):
  linear  `{path}.lora_A.weight` [r, in], `{path}.lora_B.weight` [out, r]
  experts (peft's 3D format for `target_parameters`): gate_up `mlp.experts.base_layer.lora_A.weight` [E*r, H]
          (rows expert-major) and `.lora_B.weight` [2I, E*r] (columns expert-fastest); down
          `mlp.experts.lora_A.weight` [E*r, I], `mlp.experts.lora_B.weight` [H, E*r].
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from quant.kernels.grouped import grouped_mm, grouped_mm_t
from quant.kernels.nvfp4_moe import nvfp4_moe_forward, nvfp4_moe_input_grad, nvfp4_moe_linear
from quant.kernels.nvfp4_moe import prepare as nvfp4_prepare
from rl.model.lean import row_chunks

PEFT_PREFIX = "base_model.model."
# transformers module names LoRA can target; q_proj/k_proj also match the indexer's (self_attn.indexer.{q,k}_proj)
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"]


@dataclass
class LoRAConfig:
    rank: int = 32
    alpha: float = 64.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(TARGET_MODULES))
    target_experts: bool = True
    # The indexer's projections only choose MSA blocks (a discrete top-k), so a token-level loss gives their LoRA
    # no gradient; adapting them changes nothing during RL unless another loss trains them. Kept configurable.
    target_indexer: bool = True

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def validate(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora.rank={self.rank}: must be >= 1 (the engine serves fewer: rl/config.py checks)")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora.dropout={self.dropout}: must be in [0, 1)")
        if unknown := sorted(set(self.target_modules) - set(TARGET_MODULES)):  # a typo would adapt nothing
            raise ValueError(f"lora.target_modules: {unknown} name no projection; the targets are {TARGET_MODULES}")


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float, plain: bool = False) -> torch.Tensor:
    """vLLM's order: A as the engine holds it (x's dtype), shrink in fp32, cast to x's dtype, expand with B*scaling
    rounded to x's dtype. `plain`: peft's order on the trainer's masters instead (A and B in their own dtype, the
    GEMMs in the promoted dtype, then the scaling), what a trainer unaware of the engine computes."""
    if plain:
        dt = torch.promote_types(x.dtype, a.dtype)  # peft casts x to the adapter's dtype (fp32 masters: fp32)
        return ((x.to(dt) @ a.to(dt).t()) @ b.to(dt).t() * scaling).to(x.dtype)
    h = _Shrink.apply(x, a.to(x.dtype))
    return h @ (b.to(x.dtype) * scaling).to(x.dtype).t()


def mm_fp32(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b accumulated and returned in fp32. Products of bf16/fp16 values are exact in fp32, so the fp32 GEMM and
    the 16-bit tensor-core GEMM with an fp32 accumulator (CUDA's mm out_dtype; vLLM's LoRA kernels on GPU accumulate
    that way too) differ only in the order of the sums; the latter copies no fp32 operand and runs on tensor cores."""
    if a.is_cuda and a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16):
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


class _Shrink(torch.autograd.Function):
    """bf16(fp32(x) @ fp32(a)^T), vLLM's fp32 shrink, in row chunks, saving x in its own dtype: autograd would keep
    the fp32 copy of x (4 B per element: 3.2 GB per projection input at 131K tokens of M3) for a's gradient."""

    @staticmethod
    def forward(ctx, x, a):  # noqa: D102
        x2 = x.reshape(-1, x.shape[-1])
        h = torch.empty(x2.shape[0], a.shape[0], dtype=x.dtype, device=x.device)
        for lo, hi in row_chunks(x2.shape[0]):
            h[lo:hi] = mm_fp32(x2[lo:hi], a.t())
        ctx.save_for_backward(x, a)
        return h.view(*x.shape[:-1], a.shape[0])

    @staticmethod
    def backward(ctx, gh):  # noqa: D102
        x, a = ctx.saved_tensors
        x2, g = x.reshape(-1, x.shape[-1]), gh.reshape(-1, a.shape[0])
        gx = torch.empty_like(x2) if ctx.needs_input_grad[0] else None
        ga = torch.zeros(a.shape, dtype=torch.float32, device=a.device) if ctx.needs_input_grad[1] else None
        for lo, hi in row_chunks(x2.shape[0]):
            if gx is not None:
                gx[lo:hi] = mm_fp32(g[lo:hi], a)
            if ga is not None:
                ga += mm_fp32(g[lo:hi].t(), x2[lo:hi])
        return None if gx is None else gx.view_as(x), None if ga is None else ga.to(a.dtype)


class LoRALinear(nn.Module):
    """`base(x) + B(A(x))*alpha/r` over a frozen base module (nn.Linear, MXFP8Linear, ...)."""

    def __init__(self, base: nn.Module, in_features: int, out_features: int, cfg: LoRAConfig):
        super().__init__()
        self.base, self.scaling = base, cfg.scaling
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()
        self.lora_A = nn.Parameter(torch.empty(cfg.rank, in_features))
        self.lora_B = nn.Parameter(torch.zeros(out_features, cfg.rank))  # peft's init: the adapter starts at 0
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.plain_precision = False  # rl.attribution's "plain LoRA" variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + lora_delta(self.dropout(x), self.lora_A, self.lora_B, self.scaling, self.plain_precision)


class ExpertLoRA(nn.Module):
    """Per-expert LoRA of the routed experts' fused gate_up [2I, H] and down [H, I]."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, cfg: LoRAConfig):
        super().__init__()
        r, self.scaling = cfg.rank, cfg.scaling
        self.gate_up_A = nn.Parameter(torch.empty(num_experts, r, hidden))
        self.gate_up_B = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, r))
        self.down_A = nn.Parameter(torch.empty(num_experts, r, intermediate))
        self.down_B = nn.Parameter(torch.zeros(num_experts, hidden, r))
        for a in (self.gate_up_A, self.down_A):
            for e in range(num_experts):
                nn.init.kaiming_uniform_(a[e], a=math.sqrt(5))
        self.plain_precision = False  # rl.attribution's "plain LoRA" variant (the per-expert path)

    def gate_up(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return lora_delta(x, self.gate_up_A[e], self.gate_up_B[e], self.scaling, self.plain_precision)

    def down(self, x: torch.Tensor, e: int) -> torch.Tensor:
        return lora_delta(x, self.down_A[e], self.down_B[e], self.scaling, self.plain_precision)

    def gate_up_grouped(self, x: torch.Tensor, offsets: torch.Tensor, impl: str = "auto",
                        experts: slice | None = None) -> torch.Tensor:
        """Every expert's gate_up delta at once: x [R, H] sorted by expert, rows of e at offsets[e]:offsets[e+1];
        experts: only those experts (offsets then has one entry per expert of the slice, plus one)."""
        return self._grouped("gate_up", x, offsets, impl, experts)

    def down_grouped(self, x: torch.Tensor, offsets: torch.Tensor, impl: str = "auto",
                     experts: slice | None = None) -> torch.Tensor:
        return self._grouped("down", x, offsets, impl, experts)

    def with_nvfp4_base(self, which: str, x: torch.Tensor, offsets: torch.Tensor, packed, scale, global_scale,
                        experts: slice | None = None, impl: str = "auto", **base) -> torch.Tensor:
        """``nvfp4_moe_linear(x, packed, scale, global_scale, offsets, **base)`` plus this LoRA's `which` ("gate_up" /
        "down") delta of the same experts: one autograd node with one input gradient where nvfp4_moe_linear's CUDA
        paths run (_NVFP4WithGroupedLoRA), else the two calls added."""
        cuda = nvfp4_prepare(x, packed, scale, global_scale, offsets, base.get("decoder"), base.get("impl"))
        if cuda is None:
            return (nvfp4_moe_linear(x, packed, scale, global_scale, offsets, **base)
                    + self._grouped(which, x, offsets, impl, experts))
        xb, gs, offs = cuda
        return _NVFP4WithGroupedLoRA.apply(xb.contiguous(), *self._ab(which, experts), offs, self.scaling, impl,
                                           packed, scale, gs, base)

    def _ab(self, which, experts):
        a, b = getattr(self, f"{which}_A"), getattr(self, f"{which}_B")
        return (a, b) if experts is None else (a[experts], b[experts])

    def _grouped(self, which, x, offsets, impl, experts):
        return grouped_lora_delta(x, *self._ab(which, experts), offsets, self.scaling, impl)


def _delta_forward(x, a, b, offsets, scaling, impl):
    """(delta, h, A, B * scaling): A and B*scaling in x's dtype (what vLLM serves the adapter in), the shrink h
    accumulated in fp32 and rounded once to x's dtype, then the expand."""
    dt = x.dtype
    ac = a.to(dt)
    bs = (b.to(dt) * scaling).to(dt)
    h = grouped_mm(x, ac.transpose(1, 2), offsets, impl)
    return grouped_mm(h, bs.transpose(1, 2), offsets, impl), h, ac, bs


def _delta_backward(ctx, gy, x, h, ac, bs, offsets, need_x: bool):
    """_delta_forward's gradients: x's (or None), A's and B's in their masters' dtypes (or None where not needed)."""
    impl = ctx.impl
    gy = gy.to(x.dtype).contiguous()
    gh = grouped_mm(gy, bs, offsets, impl)
    gx = grouped_mm(gh, ac, offsets, impl) if need_x else None
    ga = grouped_mm_t(gh, x, offsets, impl).to(ctx.dtypes[0]) if ctx.needs_input_grad[1] else None
    gb = None
    if ctx.needs_input_grad[2]:
        gb = (grouped_mm_t(gy, h, offsets, impl) * ctx.scaling).to(ctx.dtypes[1])
    return gx, ga, gb


class _GroupedLoRADelta(torch.autograd.Function):
    """lora_delta for all experts in four grouped GEMMs (forward) and four more (backward), instead of a Python
    loop over experts whose per-expert parameter slices cost a full-size zero gradient each in backward.

    Same operands and rounding points as lora_delta (_delta_forward); the gradients reach the masters in their
    dtype."""

    @staticmethod
    def forward(ctx, x, a, b, offsets, scaling, impl):  # noqa: D102
        y, h, ac, bs = _delta_forward(x, a, b, offsets, scaling, impl)
        ctx.save_for_backward(x, h, ac, bs, offsets)
        ctx.scaling, ctx.impl, ctx.dtypes = scaling, impl, (a.dtype, b.dtype)
        return y

    @staticmethod
    def backward(ctx, gy):  # noqa: D102
        x, h, ac, bs, offsets = ctx.saved_tensors
        return (*_delta_backward(ctx, gy, x, h, ac, bs, offsets, ctx.needs_input_grad[0]), None, None, None)


class _NVFP4WithGroupedLoRA(torch.autograd.Function):
    """nvfp4_moe_linear(x) + grouped_lora_delta(x) as one node: the same forward (the two bf16 outputs added), and
    one input gradient: the LoRA's, with the base's added inside the base's GEMMs (quant's nvfp4_moe_input_grad
    accumulate=: on the decode path cuBLAS's beta = 1, one rounding of the fp32 sum) instead of autograd adding two
    bf16 [rows, in] gradients, a buffer and a pass over three of them (~13 ms of a 4-layer x 4 x 16K step:
    results/gpu/issue19_targets.json, session_19). Takes nvfp4_moe_linear's prepared CUDA operands."""

    @staticmethod
    def forward(ctx, x, a, b, offsets, scaling, impl, packed, scale, gs, base):  # noqa: D102
        y, decoded, ctx.host = nvfp4_moe_forward(x, packed, scale, gs, offsets, **base)
        delta, h, ac, bs = _delta_forward(x, a, b, offsets, scaling, impl)
        ctx.save_for_backward(x, h, ac, bs, offsets, packed, scale, gs, decoded)
        ctx.scaling, ctx.impl, ctx.dtypes, ctx.base = scaling, impl, (a.dtype, b.dtype), base
        return y + delta

    @staticmethod
    def backward(ctx, gy):  # noqa: D102
        x, h, ac, bs, offsets, packed, scale, gs, decoded = ctx.saved_tensors
        gx, ga, gb = _delta_backward(ctx, gy, x, h, ac, bs, offsets, ctx.needs_input_grad[0])
        if gx is not None:  # (contiguous: torch._grouped_mm may pad its output's rows for alignment)
            gx = nvfp4_moe_input_grad(gy, packed, scale, gs, offsets, decoded=decoded, host=ctx.host,
                                      decoder=ctx.base.get("decoder"), impl=ctx.base.get("impl"),
                                      accumulate=gx.contiguous())
        return gx, ga, gb, None, None, None, None, None, None, None


def grouped_lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor, scaling: float,
                       impl: str = "auto") -> torch.Tensor:
    """Per-expert LoRA over expert-sorted rows: x [R, in], a [E, r, in], b [E, out, r], offsets [E+1] -> [R, out].
    impl: quant.kernels.grouped's ("auto": torch._grouped_mm for bf16 on sm90+, else a loop over experts)."""
    return _GroupedLoRADelta.apply(x.contiguous(), a, b, offsets, scaling, impl)


# --- peft format -------------------------------------------------------------------------------------------------
def _experts_to_peft(m: ExpertLoRA) -> dict[str, torch.Tensor]:
    e, r = m.gate_up_A.shape[:2]

    def flat_a(a):  # [E, r, in] -> [E*r, in], expert-major rows
        return a.reshape(e * r, a.shape[-1])

    def flat_b(b):  # [E, out, r] -> [out, r*E] with the expert index fastest
        return b.permute(1, 2, 0).reshape(b.shape[1], r * e)

    return {"base_layer.lora_A.weight": flat_a(m.gate_up_A), "base_layer.lora_B.weight": flat_b(m.gate_up_B),
            "lora_A.weight": flat_a(m.down_A), "lora_B.weight": flat_b(m.down_B)}


def _experts_from_peft(m: ExpertLoRA, t: dict[str, torch.Tensor]) -> None:
    e, r = m.gate_up_A.shape[:2]
    with torch.no_grad():
        m.gate_up_A.copy_(t["base_layer.lora_A.weight"].reshape(e, r, -1))
        m.down_A.copy_(t["lora_A.weight"].reshape(e, r, -1))
        m.gate_up_B.copy_(t["base_layer.lora_B.weight"].reshape(-1, r, e).permute(2, 0, 1))
        m.down_B.copy_(t["lora_B.weight"].reshape(-1, r, e).permute(2, 0, 1))


def adapter_state_dict(model: nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every LoRA tensor of `model` under its peft name (module paths are transformers' minimax_m3_vl paths)."""
    out = {}
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):
            out[f"{PEFT_PREFIX}{path}.lora_A.weight"] = module.lora_A
            out[f"{PEFT_PREFIX}{path}.lora_B.weight"] = module.lora_B
        elif isinstance(module, ExpertLoRA):
            experts = path.removesuffix(".lora")
            out.update({f"{PEFT_PREFIX}{experts}.{k}": v for k, v in _experts_to_peft(module).items()})
    return {k: (v.detach().to(dtype) if dtype else v.detach()).contiguous() for k, v in out.items()}


def peft_config(cfg: LoRAConfig) -> dict:
    """adapter_config.json content: peft's own `LoraConfig(...).to_dict()` as `save_pretrained` writes it (sets as
    lists, here sorted so the file is the same in every process), which peft and vLLM read back
    (`target_parameters` = the 3D expert format)."""
    from peft import LoraConfig  # peft imports transformers' model machinery: only when an adapter is written/sent

    lora = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout, bias="none", task_type="CAUSAL_LM",
                      target_modules=sorted(cfg.target_modules), inference_mode=True,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"] if cfg.target_experts
                      else None,
                      exclude_modules=None if cfg.target_indexer else ["indexer.q_proj", "indexer.k_proj"])
    return json.loads(json.dumps({k: sorted(v) if isinstance(v, set) else v for k, v in lora.to_dict().items()}))


def load_adapter_tensors(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy peft-format tensors into `model`'s LoRA parameters; one error listing names/shapes that do not fit."""
    mine = adapter_state_dict(model)
    problems = [f"unexpected tensor {k}" for k in tensors if k not in mine]
    problems += [f"missing tensor {k}" for k in mine if k not in tensors]
    problems += [f"{k}: shape {tuple(tensors[k].shape)}, the model needs {tuple(v.shape)}"
                 for k, v in mine.items() if k in tensors and tensors[k].shape != v.shape]
    if problems:
        raise ValueError("adapter does not fit the model:\n  " + "\n  ".join(problems[:20]))
    with torch.no_grad():
        for path, module in model.named_modules():
            if isinstance(module, LoRALinear):
                module.lora_A.copy_(tensors[f"{PEFT_PREFIX}{path}.lora_A.weight"])
                module.lora_B.copy_(tensors[f"{PEFT_PREFIX}{path}.lora_B.weight"])
            elif isinstance(module, ExpertLoRA):
                prefix = f"{PEFT_PREFIX}{path.removesuffix('.lora')}."
                _experts_from_peft(module, {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)})


def save_adapter(model: nn.Module, cfg: LoRAConfig, out_dir, dtype=torch.bfloat16) -> Path:
    """peft's on-disk format (adapter_model.safetensors + adapter_config.json), written atomically."""
    return write_adapter(adapter_state_dict(model, dtype), cfg, out_dir)


def write_adapter(tensors: dict[str, torch.Tensor], cfg: LoRAConfig, out_dir) -> Path:
    """Write peft-named tensors (e.g. gathered from FSDP shards) in peft's on-disk format, atomically."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"))
    # the layout of peft's save_pretrained
    (tmp / "adapter_config.json").write_text(json.dumps(peft_config(cfg), indent=2, sort_keys=True))
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    return out


def lora_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for m in model.modules() if isinstance(m, (LoRALinear, ExpertLoRA))
            for n, p in m.named_parameters(recurse=False)]
