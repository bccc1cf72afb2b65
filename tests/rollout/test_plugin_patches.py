"""The plugin's patches: each applies on this build, targets what it names, and refuses unknown vLLM releases."""

import importlib

import pytest
import torch

import rollout.plugin
from rollout.plugin import patches


def test_every_patch_applies_on_vllm_cpu():
    applied = rollout.plugin.register()
    assert applied == [p.name for p in patches.PATCHES]
    assert rollout.plugin.register() == applied  # idempotent: vLLM loads plugins several times per process


def test_patches_are_in_effect():
    rollout.plugin.register()
    from vllm import _custom_ops
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as method
    from vllm.models.minimax_m3.common import indexer
    from vllm.models.minimax_m3.nvidia import model as m3

    from rollout.plugin import m3_portable, portable_ops

    assert _custom_ops.fused_minimax_m3_qknorm_rope_kv_insert is portable_ops.qknorm_rope_kv_insert
    assert indexer.select_indexer_impl_cls(topk_blocks=2) is m3_portable.PortableIndexerImpl
    backend, impl = m3.select_main_backend_and_impl_cls(topk_blocks=2, kv_cache_dtype="auto", num_kv_heads=1)
    assert impl is m3_portable.PortableSparseImpl
    norm = m3.MiniMAXGemmaRMSNorm(8, eps=1e-6)
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
    assert "rollout" in method.select_unquantized_moe_backend.__module__


def test_torchvision_stub_is_not_visible_to_transformers():
    rollout.plugin.register()
    import sys

    from transformers.utils import import_utils

    assert "torchvision" not in sys.modules and not import_utils.is_torchvision_available()


def test_unsupported_vllm_release_fails_at_import(monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.31.0")
    with pytest.raises(ImportError, match=r"supports vLLM 0\.32\.0 / 0\.33\.0, but vLLM 0\.31\.0 is installed"):
        importlib.reload(rollout.plugin)
    monkeypatch.undo()
    importlib.reload(rollout.plugin)


def test_needed_patch_for_another_release_is_refused(monkeypatch):
    patch = patches.Patch("future_op", ("0.99.0",), lambda: True, lambda: None)
    with pytest.raises(RuntimeError, match="'future_op' is needed on this machine but was written for vLLM"):
        patches.apply_patch(patch)
