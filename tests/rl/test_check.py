"""rl.check fails, and names the cause, for each way the trainer and the engine can disagree (real engine, tiny M3,
fp32): a perturbed value in an installed LoRA buffer, a changed captured expert id under routing replay, the trainer
on the unquantized base while the engine serves the quantized one, the trainer without the NVFP4 KV QDQ of the
engine's cache. The same setups pass when nothing is perturbed."""

import dataclasses

import pytest
import torch

from m3.tiny import ensure_tiny_model
from rl.check import run_check
from rl.model import M3ForTraining, TrainerModelConfig
from rl.model.lora import adapter_state_dict, peft_config
from rollout.engine import ADAPTER_ID, EngineConfig, RolloutEngine
from tests.rl.test_train import compose_cfg
from tests.rollout.engine_fixtures import prompt_ids, quantized_tiny_model

PROMPTS = [prompt_ids(24, seed=s) for s in range(3)]


def trainer(path, **kw) -> M3ForTraining:
    model = M3ForTraining(TrainerModelConfig(path=str(path), dtype="float32", **kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-zero adapter: B starts at 0 in peft's init
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def check(engine, model, *overrides, sync=True) -> dict:
    cfg = compose_cfg([f"model.path={model.mcfg.path}", "model.dtype=float32", *overrides])
    tensors, peft_cfg = adapter_state_dict(model), peft_config(model.mcfg.lora)
    if sync:
        engine.load_adapter(tensors, peft_cfg)
    return run_check(engine, model, PROMPTS, cfg, tensors, peft_cfg, max_tokens=8)


# Class-scoped: one engine alive at a time (the plugin's NVFP4 KV emulation is per process: the last engine built
# sets it)
@pytest.fixture(scope="class")
def plain():
    path = ensure_tiny_model(dtype="float32").vllm
    engine = RolloutEngine(EngineConfig(model=str(path), dtype="float32", capture_blocks=True))
    yield engine, trainer(path, base="bf16")
    engine.close()


@pytest.fixture(scope="class")
def quantized_nvfp4_kv():
    path = quantized_tiny_model("float32")
    engine = RolloutEngine(EngineConfig(model=str(path), dtype="float32", capture_blocks=True,
                                        kv_cache_dtype="nvfp4"))
    yield engine, path
    engine.close()


def failures_about(result, word) -> list[str]:
    return [f for f in result["failures"] if word in f]


class TestUnquantizedEngine:
    def test_unperturbed_passes(self, plain):
        engine, model = plain
        result = check(engine, model, "model.base=bf16")
        assert result["passed"], result["failures"]
        assert result["weights"]["installed_equals_held"] and result["replayed"] == {"routing": 1.0, "blocks": 1.0}

    def test_perturbed_installed_lora_buffer_fails_naming_the_module(self, plain):
        engine, model = plain
        engine.load_adapter(adapter_state_dict(model), peft_config(model.mcfg.lora))
        target = "model.layers.1.self_attn.o_proj"

        def perturb(worker):
            am = worker.model_runner.lora_manager._adapter_manager
            slot = am.lora_index_to_id.index(ADAPTER_ID)
            am.modules[target].lora_b_stacked[0][slot, 0, 3, 5] += 1e-3

        engine.llm.collective_rpc(perturb)
        result = check(engine, model, "model.base=bf16", sync=False)
        assert not result["passed"]
        named = f"{target}|lora_b_stacked|0: 1 values differ"
        assert any(named in f for f in failures_about(result, "weights")), result["failures"]
        engine.load_adapter(adapter_state_dict(model), peft_config(model.mcfg.lora))  # repaired by the next sync


    def test_changed_captured_expert_id_fails_naming_routing(self, plain, monkeypatch):
        engine, model = plain
        generate = engine.generate

        def generate_with_one_id_changed(*args, **kwargs):
            groups = generate(*args, **kwargs)
            r = groups[0][0]
            routing = r.routed_experts.copy()
            t, layer = len(r.prompt_ids) + 1, model.moe_layers[0]
            routing[t, layer, 0] = next(e for e in range(model.num_experts) if e not in routing[t, layer])
            groups[0][0] = dataclasses.replace(r, routed_experts=routing)
            return groups

        monkeypatch.setattr(engine, "generate", generate_with_one_id_changed)
        result = check(engine, model, "model.base=bf16")
        assert not result["passed"]
        assert failures_about(result, "routing: the trainer's own choice"), result["failures"]


class TestQuantizedEngineWithNVFP4KVCache:
    def test_unperturbed_passes(self, quantized_nvfp4_kv):
        engine, path = quantized_nvfp4_kv
        result = check(engine, trainer(path, base="quantized", kv_cache_dtype="nvfp4"), "model.base=quantized",
                       "model.kv_cache_dtype=nvfp4")
        assert result["passed"], result["failures"]

    def test_unquantized_trainer_against_quantized_engine_fails_naming_the_base(self, quantized_nvfp4_kv):
        engine, _ = quantized_nvfp4_kv
        original = ensure_tiny_model(dtype="float32").vllm  # what a plain bf16 trainer loads
        result = check(engine, trainer(original, base="bf16", kv_cache_dtype="nvfp4"), "model.base=bf16",
                       "model.kv_cache_dtype=nvfp4")
        assert not result["passed"]
        assert failures_about(result, "base: the engine serves a quantized checkpoint"), result["failures"]
        assert failures_about(result, "logprobs:"), result["failures"]  # and the numbers show it


    def test_trainer_without_nvfp4_kv_qdq_fails_naming_the_kv_cache(self, quantized_nvfp4_kv):
        engine, path = quantized_nvfp4_kv
        result = check(engine, trainer(path, base="quantized"), "model.base=quantized")
        assert not result["passed"]
        assert failures_about(result, "kv_cache_dtype: the engine runs 'nvfp4', the trainer 'auto'"), result["failures"]
        assert failures_about(result, "logprobs:"), result["failures"]
