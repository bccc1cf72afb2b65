"""rl.check fails, and names the cause, for each way the trainer and the engine can disagree (real engine, tiny M3,
fp32): a perturbed value in an installed LoRA buffer, a changed captured expert id under routing replay, the trainer
on the unquantized base while the engine serves the quantized one, the trainer without the NVFP4 KV QDQ of the
engine's cache. The same setups pass when nothing is perturbed; the attribution names the KV QDQ and the plain bf16
base when they are removed. In bf16 with fp32 LoRA masters (what training holds), the trainer's LoRA layers equal the engine's bitwise."""

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


def trainer(path, dtype="float32", **kw) -> M3ForTraining:
    model = M3ForTraining(TrainerModelConfig(path=str(path), dtype=dtype, **kw))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # a non-zero adapter: B starts at 0 in peft's init
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def check(engine, model, *overrides, sync=True) -> dict:
    cfg = compose_cfg([f"model.path={model.mcfg.path}", f"model.dtype={model.mcfg.dtype}", *overrides])
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


    def test_attribution_names_the_kv_qdq_as_the_source(self, quantized_nvfp4_kv):
        engine, path = quantized_nvfp4_kv
        result = check(engine, trainer(path, base="quantized", kv_cache_dtype="nvfp4"), "model.base=quantized",
                       "model.kv_cache_dtype=nvfp4", "check.attribution=true")
        rows = result["attribution"]["variants"]
        assert set(rows) == {"exact", "no_routing_replay", "no_block_replay", "bf16_base", "no_kv_qdq", "plain_lora"}
        assert rows["exact"]["kl_k3"] <= 1e-6 and rows["exact"]["logprob_abs_diff_mean"] <= 1e-4, rows
        assert rows["no_kv_qdq"]["kl_k3"] > 100 * max(rows["exact"]["kl_k3"], 1e-9), rows
        assert rows["bf16_base"]["kl_k3"] > 100 * max(rows["exact"]["kl_k3"], 1e-12), rows  # plain bf16 weights


class TestBF16LoRAPrecision:
    """The engine holds the adapter in bf16 while training keeps fp32 masters: the trainer's LoRA must round A and B
    as the engine holds them. Compared layer by layer on the engine's own captured inputs (whole-model logprobs of
    a random tiny model in bf16 also carry the attention kernels' op-order noise, which hides this)."""

    LAYERS = ("model.layers.0.self_attn.o_proj", "model.layers.1.block_sparse_moe.shared_experts.down_proj")

    def test_lora_linears_equal_the_engines_bitwise(self):
        path = quantized_tiny_model("bfloat16")
        engine = RolloutEngine(EngineConfig(model=str(path), dtype="bfloat16", capture_routing=False))
        try:
            model = trainer(path, dtype="bfloat16", base="quantized")  # fp32 masters, values bf16 cannot hold
            engine.load_adapter(adapter_state_dict(model), peft_config(model.mcfg.lora))
            seen = {}

            def keep(name, inputs, output):  # the first call: the prompt's prefill
                if name not in seen:
                    seen[name] = (inputs[0].clone(), (output[0] if isinstance(output, tuple) else output).clone())

            def capture(worker):
                for name, module in worker.model_runner.model.named_modules():
                    if name in self.LAYERS:
                        module.register_forward_hook(lambda m, i, o, name=name: keep(name, i, o))

            engine.llm.collective_rpc(capture)  # in-process engine: the hooks fill `seen` here
            engine.generate(PROMPTS[:1], n=1, max_tokens=1, seed=0)
        finally:
            engine.close()
        assert set(seen) == set(self.LAYERS)
        mine = dict(model.named_modules())
        for name, (x, engine_out) in seen.items():
            layer = mine[name.replace("block_sparse_moe", "mlp")]
            with torch.no_grad():
                assert torch.equal(layer(x), engine_out), name
                layer.plain_precision = True  # peft's order on the fp32 masters: what the engine does not compute
                assert not torch.equal(layer(x), engine_out), name
