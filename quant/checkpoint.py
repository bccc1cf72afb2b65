"""Checkpoint IO for the served quantized formats: read them lazily into packed tensors, write them.

Formats (per module ``P``, i.e. the tensors ``P.weight`` and its companions):
- ModelOpt NVFP4 (``quant_algo`` ``NVFP4`` = W4A4, ``W4A16_NVFP4`` = weight-only): ``P.weight`` uint8
  [N, K/2] (even element in the low nibble), ``P.weight_scale`` float8_e4m3fn [N, K/16],
  ``P.weight_scale_2`` fp32 (one value; the decode multiplier amax / (6 * 448)) and, for W4A4,
  ``P.input_scale`` fp32 (the static activation decode scale).
- MXFP8, ModelOpt or MiniMax-native: ``P.weight`` float8_e4m3fn [N, K] and an E8M0 scale (uint8 or
  float8_e8m0fnu) [N, K/32] named ``P.weight_scale`` (ModelOpt) or ``P.weight_scale_inv`` (MiniMax;
  vLLM's M3 loader renames it, the bytes are the same).
- Everything else (norms, embeddings, router, lm_head) is stored as it is.

Which module has which format comes from ``config.json``'s ``quantization_config`` (or a legacy
``hf_quant_config.json``): ModelOpt ``MIXED_PRECISION`` with a per-module ``quantized_layers`` map,
a uniform ModelOpt algo with an ``ignore`` / ``exclude_modules`` list, or MiniMax's
``{"quant_method": "mxfp8", "ignored_layers": [...]}``.

Nothing is loaded eagerly: opening a checkpoint reads only the safetensors headers (names, dtypes,
shapes) and validates the whole layout from them, so a wrong or missing key, a shape that is not a
multiple of the block, or an unknown quant method fails at once with one ``CheckpointError`` naming
the tensor and the reason. Tensors are then read one at a time with ``safe_open``, and the writer
flushes shards as it goes, so converting a model never holds more than one shard plus the module
being converted (never a bf16 copy of all experts).

Torch and safetensors only: the trainer imports this without vLLM.
"""

from __future__ import annotations

import fnmatch
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from quant import mxfp8, nvfp4
from quant._common import E2M1_MAX, E4M3_MAX

__all__ = [
    "CheckpointError",
    "CheckpointWriter",
    "MXFP8Weight",
    "NVFP4Weight",
    "NVFP4_ALGOS",
    "QuantScheme",
    "QuantizedCheckpoint",
    "mixed_precision_config",
    "nvfp4_global_scale",
    "parse_quant_config",
    "quantize_mxfp8",
    "quantize_nvfp4",
    "read_headers",
]

NVFP4_ALGOS = ("NVFP4", "W4A16_NVFP4")
MXFP8_ALGO = "MXFP8"
KNOWN_ALGOS = (*NVFP4_ALGOS, MXFP8_ALGO)
SCALE_SUFFIXES = ("weight_scale", "weight_scale_inv", "weight_scale_2", "input_scale")
INDEX_FILE = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A checkpoint (or a tensor handed to the writer) does not have the layout its format needs."""


# ---------------------------------------------------------------------------------------------
# Packed weights


@dataclass(frozen=True)
class NVFP4Weight:
    packed: torch.Tensor  # uint8 [..., N, K/2]
    scale: torch.Tensor  # float8_e4m3fn [..., N, K/16]
    global_scale: torch.Tensor  # fp32, one value: ModelOpt weight_scale_2 (decode)
    input_scale: torch.Tensor | None = None  # fp32, one value: ModelOpt input_scale (decode), W4A4 only

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """RNE_dtype(e2m1 * (s * gs)), vLLM's ``dequantize_to_dtype`` order. (The Hopper kernels
        instead apply gs to the fp32 accumulator: ``quant.forms.nvfp4_linear``.)"""
        return nvfp4.dequantize(self.packed, self.scale, self.global_scale, dtype)


@dataclass(frozen=True)
class MXFP8Weight:
    weight: torch.Tensor  # float8_e4m3fn [..., N, K]
    scale: torch.Tensor  # uint8 E8M0 [..., N, K/32]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def dequantize(self, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        """e4m3 * 2^(byte-127), exact in bf16 and fp32."""
        return mxfp8.dequantize(self.weight, self.scale, dtype)


def _check_float_weight(w: torch.Tensor, name: str, block: int, fmt: str) -> None:
    if not w.is_floating_point() or w.element_size() < 2:
        raise CheckpointError(f"{name}: dtype {w.dtype}; {fmt} quantizes a bf16/fp16/fp32 weight")
    if w.ndim < 2 or w.shape[-1] % block != 0:
        raise CheckpointError(
            f"{name}: shape {tuple(w.shape)}; {fmt} needs [..., N, K] with K a multiple of its block {block}")
    if not torch.isfinite(w).all():
        raise CheckpointError(f"{name}: holds NaN/Inf; refusing to quantize it")


def nvfp4_global_scale(*weights: torch.Tensor) -> torch.Tensor:
    """ModelOpt's decode global scale amax / (6 * 448) in fp32, the amax taken over all ``weights``
    (pass gate and up together: vLLM serves the fused w13 with the gate's scale). An all-zero
    weight gets 1.0: every code is 0 then, and 0 / 2688 would make vLLM's encode scale infinite."""
    amax = torch.stack([w.detach().abs().amax().to(torch.float32) for w in weights]).amax()
    if amax == 0:
        return torch.tensor(1.0, dtype=torch.float32)
    return amax / (E2M1_MAX * E4M3_MAX)


def quantize_nvfp4(w: torch.Tensor, global_scale: torch.Tensor | None = None, *,
                   input_scale: torch.Tensor | None = None, name: str = "weight") -> NVFP4Weight:
    """A float weight [..., N, K] -> NVFP4 with vLLM's reference quantizer (``ref_nvfp4_quant`` with
    encode scale fp32(1 / global_scale)); ``global_scale`` defaults to ``nvfp4_global_scale(w)``."""
    _check_float_weight(w, name, nvfp4.BLOCK, "NVFP4")
    gs = nvfp4_global_scale(w) if global_scale is None else global_scale.detach().to(torch.float32).reshape(())
    if not (torch.isfinite(gs) and gs > 0):
        raise CheckpointError(f"{name}: global scale {float(gs)!r} must be finite and > 0")
    packed, scale = nvfp4.quantize(w.detach(), gs)
    if input_scale is not None:
        input_scale = input_scale.detach().to(torch.float32).reshape(())
    return NVFP4Weight(packed, scale, gs, input_scale)


def quantize_mxfp8(w: torch.Tensor, *, name: str = "weight") -> MXFP8Weight:
    """A float weight [..., N, K] -> MXFP8 with vLLM's torch quantizer (ceil-rule E8M0 scales)."""
    _check_float_weight(w, name, mxfp8.BLOCK, "MXFP8")
    q, s = mxfp8.quantize(w.detach())
    return MXFP8Weight(q, s)


# ---------------------------------------------------------------------------------------------
# quantization_config


@dataclass(frozen=True)
class QuantScheme:
    """Which quant_algo each module has. ``layers`` (MIXED_PRECISION) names every quantized module;
    otherwise ``default`` applies to every module that is not ``excluded``."""

    method: str
    default: str | None
    layers: dict[str, str]
    exclude: tuple[str, ...]
    mixed: bool

    def is_excluded(self, prefix: str) -> bool:
        return any(prefix == p or prefix.startswith(p.rstrip("*").rstrip(".") + ".") or fnmatch.fnmatchcase(prefix, p)
                   for p in self.exclude)

    def algo(self, prefix: str) -> str | None:
        if self.mixed:
            return self.layers.get(prefix)
        return None if self.is_excluded(prefix) else self.default


def _algo(value, where: str) -> str:
    algo = str(value or "").upper()
    if algo not in KNOWN_ALGOS:
        raise CheckpointError(f"{where}={value!r}: unknown quant algo; supported: {', '.join(KNOWN_ALGOS)}")
    return algo


def parse_quant_config(cfg: dict | None, where: str = "quantization_config") -> QuantScheme | None:
    """``config.json``'s quantization_config (or hf_quant_config.json) -> QuantScheme; None if absent."""
    if cfg is None:
        return None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{where}: expected a JSON object, got {type(cfg).__name__}")
    method = str(cfg.get("quant_method", "modelopt" if "quantization" in cfg else "")).lower()
    if method == "mxfp8":  # MiniMax-native
        return QuantScheme(method, MXFP8_ALGO, {}, tuple(cfg.get("ignored_layers") or ()), False)
    if not method.startswith("modelopt"):
        raise CheckpointError(
            f"{where}.quant_method={cfg.get('quant_method')!r}: unknown quant method; supported: 'modelopt' "
            f"(quant_algo {', '.join(KNOWN_ALGOS)} or MIXED_PRECISION) and MiniMax 'mxfp8'")
    body, key = (cfg["quantization"], f"{where}.quantization") if "quantization" in cfg else (cfg, where)
    if not isinstance(body, dict):
        raise CheckpointError(f"{key}: expected a JSON object, got {type(body).__name__}")
    exclude = body.get("exclude_modules", body.get("ignore", [])) or []
    if not isinstance(exclude, list):
        raise CheckpointError(f"{key}.exclude_modules: expected a list, got {type(exclude).__name__}")
    algo = str(body.get("quant_algo") or "").upper()
    if algo != "MIXED_PRECISION":
        return QuantScheme("modelopt", _algo(body.get("quant_algo"), f"{key}.quant_algo"), {}, tuple(exclude), False)
    layers = body.get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        raise CheckpointError(f"{key}.quantized_layers: MIXED_PRECISION needs a non-empty per-module map")
    parsed = {}
    for prefix, info in layers.items():
        if not isinstance(info, dict):
            raise CheckpointError(f"{key}.quantized_layers[{prefix!r}]: expected an object with quant_algo")
        parsed[prefix] = _algo(info.get("quant_algo"), f"{key}.quantized_layers[{prefix!r}].quant_algo")
        group = info.get("group_size")
        want = mxfp8.BLOCK if parsed[prefix] == MXFP8_ALGO else nvfp4.BLOCK
        if group is not None and int(group) != want:
            raise CheckpointError(f"{key}.quantized_layers[{prefix!r}].group_size={group}: "
                                  f"{parsed[prefix]} uses blocks of {want}")
    return QuantScheme("modelopt", None, parsed, tuple(exclude), True)


def mixed_precision_config(layer_algos: dict[str, str], ignore: list[str] | tuple[str, ...] = ()) -> dict:
    """ModelOpt MIXED_PRECISION quantization_config for config.json (vLLM: ``modelopt_mixed``)."""
    layers = {}
    for prefix, algo in sorted(layer_algos.items()):
        algo = _algo(algo, f"quantized_layers[{prefix!r}]")
        layers[prefix] = {"quant_algo": algo, "group_size": mxfp8.BLOCK if algo == MXFP8_ALGO else nvfp4.BLOCK}
    return {"quant_method": "modelopt", "quant_algo": "MIXED_PRECISION", "kv_cache_scheme": None,
            "ignore": list(ignore), "quantized_layers": layers}


# ---------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class _Info:
    file: Path
    dtype: str  # safetensors dtype string: U8, F8_E4M3, F8_E8M0, F32, BF16, ...
    shape: tuple[int, ...]


def read_headers(path: str | os.PathLike) -> dict[str, _Info]:
    """Every tensor of a checkpoint directory (its index's shards, else every *.safetensors) -> file, dtype,
    shape, from the safetensors headers only."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    info = {}
    for name in files:
        if not (path / name).is_file():
            raise CheckpointError(f"{path}: {INDEX_FILE} names {name}, which is not there")
        with safe_open(path / name, "pt") as f:
            for key in f.keys():
                sl = f.get_slice(key)
                if key in info:
                    raise CheckpointError(f"{key}: stored in both {info[key].file.name} and {name}")
                info[key] = _Info(path / name, sl.get_dtype(), tuple(sl.get_shape()))
    return info


class QuantizedCheckpoint:
    """A checkpoint directory opened lazily: headers now, tensors on ``read`` / ``tensor``."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        cfg_file = self.path / "config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        qcfg, where = self.config.get("quantization_config"), "config.json quantization_config"
        legacy = self.path / "hf_quant_config.json"
        if qcfg is None and legacy.is_file():
            qcfg, where = json.loads(legacy.read_text()), "hf_quant_config.json"
        self.scheme = parse_quant_config(qcfg, where)
        self._info = read_headers(self.path)
        self._modules = self._validate()

    # -- layout -----------------------------------------------------------------------------
    def _validate(self) -> dict[str, str | None]:
        """Check every module's tensors against its format (headers only); prefix -> algo."""
        modules: dict[str, str | None] = {}
        for name in self._info:
            prefix, _, suffix = name.rpartition(".")
            if suffix in SCALE_SUFFIXES and f"{prefix}.weight" not in self._info:
                raise CheckpointError(f"{name}: quantization scale without its weight {prefix}.weight")
            if suffix == "weight":
                modules[prefix] = None
        for prefix in modules:
            has_scales = [s for s in SCALE_SUFFIXES if f"{prefix}.{s}" in self._info]
            algo = self.scheme.algo(prefix) if self.scheme else None
            if algo is None and has_scales:
                why = ("quantization_config.quantized_layers does not list it" if self.scheme and self.scheme.mixed
                       else "it is excluded" if self.scheme else "config.json has no quantization_config")
                raise CheckpointError(f"{prefix}.{has_scales[0]}: quantization tensor on an unquantized module ({why})")
            if algo is not None and not self.scheme.mixed and not has_scales:
                algo = None  # uniform configs: norms, embeddings etc. carry no scales and stay as stored
            if algo is None and self._info[f"{prefix}.weight"].dtype in ("U8", "F8_E4M3"):
                raise CheckpointError(f"{prefix}.weight: dtype {self._info[f'{prefix}.weight'].dtype} without "
                                      "quantization scales or a quantization_config entry")
            if algo in NVFP4_ALGOS:
                self._check_nvfp4(prefix, algo)
            elif algo == MXFP8_ALGO:
                self._check_mxfp8(prefix)
            modules[prefix] = algo
        if self.scheme and self.scheme.mixed:
            for prefix in self.scheme.layers:
                if prefix not in modules:
                    raise CheckpointError(f"{prefix}.weight: missing (quantized_layers lists {prefix!r})")
        return modules

    def _need(self, name: str, dtypes: tuple[str, ...], what: str) -> _Info:
        info = self._info.get(name)
        if info is None:
            raise CheckpointError(f"{name}: missing ({what})")
        if info.dtype not in dtypes:
            raise CheckpointError(f"{name}: dtype {info.dtype}; expected {' or '.join(dtypes)} ({what})")
        return info

    def _no_extra(self, prefix: str, allowed: set[str], fmt: str) -> None:
        for s in SCALE_SUFFIXES:
            if s not in allowed and f"{prefix}.{s}" in self._info:
                raise CheckpointError(f"{prefix}.{s}: unexpected for an {fmt} module")

    def _check_nvfp4(self, prefix: str, algo: str) -> None:
        w = self._need(f"{prefix}.weight", ("U8",), f"{algo} weight, two E2M1 codes per byte")
        if len(w.shape) < 2:
            raise CheckpointError(f"{prefix}.weight: shape {w.shape}; {algo} needs [..., N, K/2]")
        k = 2 * w.shape[-1]
        if k % nvfp4.BLOCK:
            raise CheckpointError(f"{prefix}.weight: shape {w.shape} gives K={k}, not a multiple of the NVFP4 "
                                  f"block {nvfp4.BLOCK}")
        s = self._need(f"{prefix}.weight_scale", ("F8_E4M3", "U8"), f"{algo} block scale, E4M3")
        if s.shape != (*w.shape[:-1], k // nvfp4.BLOCK):
            raise CheckpointError(f"{prefix}.weight_scale: shape {s.shape}; expected {(*w.shape[:-1], k // 16)} "
                                  f"for weight {w.shape}")
        lead = w.shape[:-2]
        for suffix in ("weight_scale_2", "input_scale"):
            name = f"{prefix}.{suffix}"
            if suffix == "input_scale" and name not in self._info:
                if algo == "NVFP4":
                    raise CheckpointError(f"{name}: missing (quant_algo NVFP4 is W4A4 and needs the static "
                                          "activation scale; weight-only checkpoints declare W4A16_NVFP4)")
                continue
            g = self._need(name, ("F32",), f"{algo} global scale, fp32")
            if math.prod(g.shape) != 1 and g.shape != lead:
                raise CheckpointError(f"{name}: shape {g.shape}; expected one value per weight")
        self._no_extra(prefix, {"weight_scale", "weight_scale_2", "input_scale"}, algo)

    def _check_mxfp8(self, prefix: str) -> None:
        w = self._need(f"{prefix}.weight", ("F8_E4M3",), "MXFP8 weight, E4M3 elements")
        if len(w.shape) < 2 or w.shape[-1] % mxfp8.BLOCK:
            raise CheckpointError(f"{prefix}.weight: shape {w.shape}; MXFP8 needs [..., N, K] with K a multiple "
                                  f"of its block {mxfp8.BLOCK}")
        names = [f"{prefix}.{s}" for s in ("weight_scale", "weight_scale_inv") if f"{prefix}.{s}" in self._info]
        if len(names) != 1:
            why = ("missing (MXFP8 needs weight_scale or weight_scale_inv)" if not names
                   else "both weight_scale and weight_scale_inv; MXFP8 has one scale")
            raise CheckpointError(f"{prefix}.weight_scale: {why}")
        s = self._need(names[0], ("U8", "F8_E8M0"), "MXFP8 block scale, E8M0")
        if s.shape != (*w.shape[:-1], w.shape[-1] // mxfp8.BLOCK):
            raise CheckpointError(f"{names[0]}: shape {s.shape}; expected "
                                  f"{(*w.shape[:-1], w.shape[-1] // mxfp8.BLOCK)} for weight {w.shape}")
        self._no_extra(prefix, {"weight_scale", "weight_scale_inv"}, "MXFP8")

    # -- access -----------------------------------------------------------------------------
    def tensor_names(self) -> list[str]:
        return sorted(self._info)

    def modules(self) -> dict[str, str | None]:
        """Every module with a ``.weight`` -> its quant algo (None: stored unquantized)."""
        return dict(self._modules)

    def algo(self, prefix: str) -> str | None:
        if prefix not in self._modules:
            raise CheckpointError(f"{prefix}.weight: no such module in {self.path}")
        return self._modules[prefix]

    def tensor(self, name: str) -> torch.Tensor:
        info = self._info.get(name)
        if info is None:
            raise CheckpointError(f"{name}: no such tensor in {self.path}")
        with safe_open(info.file, "pt") as f:
            return f.get_tensor(name)

    def read(self, prefix: str) -> NVFP4Weight | MXFP8Weight | torch.Tensor:
        """One module's weight in its stored format (a plain tensor when unquantized)."""
        algo = self.algo(prefix)
        if algo is None:
            return self.tensor(f"{prefix}.weight")
        if algo == MXFP8_ALGO:
            sname = f"{prefix}.weight_scale" if f"{prefix}.weight_scale" in self._info else f"{prefix}.weight_scale_inv"
            return MXFP8Weight(self.tensor(f"{prefix}.weight"), self.tensor(sname).view(torch.uint8))
        gs = self._positive_scale(f"{prefix}.weight_scale_2")
        inp = self._positive_scale(f"{prefix}.input_scale") if f"{prefix}.input_scale" in self._info else None
        scale = self.tensor(f"{prefix}.weight_scale").view(torch.float8_e4m3fn)
        return NVFP4Weight(self.tensor(f"{prefix}.weight"), scale, gs, inp)

    def _positive_scale(self, name: str) -> torch.Tensor:
        t = self.tensor(name).to(torch.float32)
        if not (torch.isfinite(t).all() and (t > 0).all()):
            raise CheckpointError(f"{name}: {t.tolist()}; a global scale must be finite and > 0")
        return t.reshape(()) if t.numel() == 1 else t

    def dequantized(self, prefix: str, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
        w = self.read(prefix)
        return w if isinstance(w, torch.Tensor) else w.dequantize(dtype)

    def iter_dequantized(self, dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) for the model as a plain state dict, one tensor at a time: quantized
        weights dequantized to ``dtype``, their scales dropped, everything else as stored."""
        for name in self.tensor_names():
            prefix, _, suffix = name.rpartition(".")
            if prefix in self._modules and self._modules[prefix] is not None:
                if suffix == "weight":
                    yield name, self.dequantized(prefix, dtype)
                continue  # scales
            yield name, self.tensor(name)


# ---------------------------------------------------------------------------------------------
# Writing


class CheckpointWriter:
    """Writes safetensors shards as tensors arrive (at most ``max_shard_bytes`` buffered), then
    ``model.safetensors`` (one shard) or ``model-0000i-of-0000n.safetensors`` + the HF index."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 4 << 30):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        if any(self.out.glob("*.safetensors")) or (self.out / INDEX_FILE).exists():
            raise CheckpointError(f"{self.out}: already holds safetensors files; refusing to mix checkpoints")
        self.max_shard_bytes = max_shard_bytes
        self._buf: dict[str, torch.Tensor] = {}
        self._buf_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self._total = 0
        self._closed = False

    def __enter__(self) -> CheckpointWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            if not self._closed:
                self.close()
        else:
            for path, _ in self._shards:
                path.unlink(missing_ok=True)

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise CheckpointError(f"{name}: the writer for {self.out} is already closed")
        if name in self._names:
            raise CheckpointError(f"{name}: written twice")
        # Own copy: safetensors refuses tensors sharing storage (one global scale object used for
        # both w1 and w3), and a view would drag its base's whole storage into the file.
        t = tensor.detach().cpu().contiguous().clone()
        nbytes = t.numel() * t.element_size()
        if self._buf and self._buf_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._names.add(name)
        self._buf[name] = t
        self._buf_bytes += nbytes
        self._total += nbytes

    def add_module(self, prefix: str, w: NVFP4Weight | MXFP8Weight | torch.Tensor, *,
                   mxfp8_scale_name: str = "weight_scale") -> None:
        """``prefix.weight`` and its companions in the ModelOpt (or, with ``weight_scale_inv``,
        MiniMax) names."""
        if isinstance(w, NVFP4Weight):
            self.add(f"{prefix}.weight", w.packed)
            self.add(f"{prefix}.weight_scale", w.scale.view(torch.float8_e4m3fn))
            self.add(f"{prefix}.weight_scale_2", w.global_scale.to(torch.float32))
            if w.input_scale is not None:
                self.add(f"{prefix}.input_scale", w.input_scale.to(torch.float32))
        elif isinstance(w, MXFP8Weight):
            if mxfp8_scale_name not in ("weight_scale", "weight_scale_inv"):
                raise CheckpointError(f"{prefix}.{mxfp8_scale_name}: MXFP8 scales are weight_scale or weight_scale_inv")
            self.add(f"{prefix}.weight", w.weight)
            self.add(f"{prefix}.{mxfp8_scale_name}", w.scale.view(torch.uint8))
        else:
            self.add(f"{prefix}.weight", w)

    def _flush(self) -> None:
        path = self.out / f".shard-{len(self._shards):05d}.safetensors.tmp"
        save_file(dict(sorted(self._buf.items())), str(path), metadata={"format": "pt"})
        self._shards.append((path, sorted(self._buf)))
        self._buf, self._buf_bytes = {}, 0

    def close(self) -> list[Path]:
        if self._closed:
            raise CheckpointError(f"{self.out}: checkpoint already closed")
        self._closed = True
        if self._buf or not self._shards:
            self._flush()
        n = len(self._shards)
        names = ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        weight_map = {}
        for (tmp, keys), name in zip(self._shards, names):
            tmp.rename(self.out / name)
            (self.out / name).chmod(0o644)
            weight_map.update({k: name for k in keys})
        if n > 1:
            index = {"metadata": {"total_size": self._total}, "weight_map": dict(sorted(weight_map.items()))}
            (self.out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        self._shards = []
        return [self.out / name for name in names]
