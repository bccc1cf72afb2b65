"""The trainer model's choices, one Enum each: the structured config (rl/config.py) types its fields with them, so
Hydra rejects a bad value at composition, and TrainerModelConfig checks direct callers against the same lists."""

from enum import StrEnum  # members compare, print and serialise as their values


class DType(StrEnum):
    bfloat16 = "bfloat16"
    float32 = "float32"


class Base(StrEnum):
    quantized = "quantized"  # NVFP4 routed experts + MXFP8 projections, as the engine serves them
    bf16 = "bf16"


class Profile(StrEnum):  # the serving form of the quantized base (quant/serving.py)
    hopper = "hopper"
    blackwell = "blackwell"


class KVCacheDType(StrEnum):
    auto = "auto"
    nvfp4 = "nvfp4"


class IndexerKVDType(StrEnum):
    bf16 = "bf16"
    nvfp4 = "nvfp4"


class AttentionImpl(StrEnum):  # MSA (rl/model/msa.py)
    auto = "auto"
    reference = "reference"
    block = "block"  # KV-block-outer Triton kernels (rl/model/msa_block_outer.py), what auto picks on CUDA
    triton = "triton"  # per-token Triton kernels (rl/model/msa_triton.py)
    flex = "flex"


class MoEImpl(StrEnum):
    auto = "auto"
    loop = "loop"
    grouped = "grouped"


def check_choice(key: str, value, enum: type[StrEnum]) -> None:
    """One error naming the key and the allowed values."""
    if value not in {m.value for m in enum}:
        raise ValueError(f"{key}={value!r}: expected one of {[m.value for m in enum]}")
