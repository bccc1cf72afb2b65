"""Whether the Triton kernels of ``quant.kernels`` can run here; shared by every kernel module so none imports
another just for this check."""

import functools

import torch

__all__ = ["triton_available", "triton_version"]


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when Triton imports and CUDA is available (the kernels' precondition)."""
    if not torch.cuda.is_available():
        return False
    try:
        import triton  # noqa: F401  (optional dependency: CPU installs run without it)
    except ImportError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def triton_version() -> tuple[int, int]:
    """(major, minor) of the importable Triton, (0, 0) without one: kernel configs that depend on its codegen."""
    try:
        import triton
    except ImportError:
        return (0, 0)
    return tuple(int(p) for p in triton.__version__.split(".")[:2])
