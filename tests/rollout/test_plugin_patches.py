"""The plugin's patches: each applies on this build, targets what it names, and refuses unknown vLLM releases."""

import importlib

import pytest
import torch

import rollout.plugin
from rollout.plugin import patches, registry


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
    from vllm.v1.engine.core_client import SyncMPClient

    assert SyncMPClient.shutdown.__module__ == "rollout.plugin.patches"  # engine_death_wakes_waiters


def test_cpu_tp_shared_memory_is_named_per_job(monkeypatch):
    """Two torchrun jobs with external-launcher engines (init method env://) on one host: their TP groups' shared
    memory names differ (vLLM's own name is the same for both) and hold no "/" past the first character (shm_open);
    a tcp:// job keeps vLLM's name."""
    import os
    from types import SimpleNamespace

    rollout.plugin.register()
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed

    tp = SimpleNamespace(unique_name="tp:0", ranks=[0, 1])
    monkeypatch.setenv("VLLM_DIST_IDENT", "//")
    names = []
    for port in ("29500", "29501"):
        monkeypatch.setenv("MASTER_PORT", port)
        names.append(_CPUSHMDistributed.make_group_name(tp))
    assert names == [f"{port}.{os.getppid()}-tp:0-[0-1]-cpushm" for port in ("29500", "29501")]
    monkeypatch.setenv("VLLM_DIST_IDENT", "41234")
    assert _CPUSHMDistributed.make_group_name(tp) == "41234-tp:0-[0-1]-cpushm"


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
    patch = registry.Patch("future_op", ("0.99.0",), lambda: True, lambda: None)
    with pytest.raises(RuntimeError, match="'future_op' is needed on this machine but was written for vLLM"):
        registry.apply_patch(patch)


def test_cpu_punica_ops_are_grouped_and_match_vllms_torch_ops():
    """The grouped ops give vLLM's own torch ops' results (one GEMM per slot instead of per-token gathers), and
    tokens without an adapter (-1) get no delta, where vLLM's torch ops read the last slot."""
    rollout.plugin.register()
    from vllm.lora.ops import torch_ops as vllm_ops
    from vllm.lora.punica_wrapper import punica_cpu as wrapper

    from rollout.plugin import punica_cpu

    assert all(getattr(wrapper, name) is getattr(punica_cpu, name) for name in punica_cpu.OPS)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 16, generator=g)
    a = torch.randn(3, 1, 4, 16, generator=g)  # [slots, 1, rank, in]
    b = torch.randn(3, 1, 10, 4, generator=g)  # [slots, 1, out, rank]
    idx = torch.tensor([0, 2, 2, 1, 0, 2, 1])
    for mine, theirs in ((punica_cpu.bgmv_shrink, vllm_ops.bgmv_shrink),):
        y0, y1 = torch.zeros(7, 4), torch.zeros(7, 4)
        mine(x, a, y0, idx, 0.5)
        theirs(x, a, y1, idx, 0.5)
        torch.testing.assert_close(y0, y1, rtol=1e-6, atol=1e-6)
    h = torch.randn(7, 4, generator=g)
    for add in (True, False):
        y0, y1 = torch.ones(7, 30), torch.ones(7, 30)
        punica_cpu.bgmv_expand_slice(h, b, y0, idx, 12, 10, add)
        vllm_ops.bgmv_expand_slice(h, b, y1, idx, 12, 10, add)
        torch.testing.assert_close(y0, y1, rtol=1e-6, atol=1e-6)
        y0, y1 = torch.ones(7, 10), torch.ones(7, 10)
        punica_cpu.sgmv_expand(h, b, y0, None, torch.tensor([3, 4]), torch.tensor([1, 0]), 2, 4, 7, add)
        vllm_ops.sgmv_expand(h, b, y1, None, torch.tensor([3, 4]), torch.tensor([1, 0]), 2, 4, 7, add)
        torch.testing.assert_close(y0, y1, rtol=1e-6, atol=1e-6)
    y = torch.full((7, 4), 9.0)
    punica_cpu.sgmv_shrink(x, a, y, None, torch.tensor([3, 4]), torch.tensor([-1, 2]), 2, 4, 7, 1.0)
    assert (y[:3] == 0).all()
    torch.testing.assert_close(y[3:], x[3:] @ a[2, 0].t())
