"""The trainer model against the real engine serving the same checkpoint with the same adapter.

fp32 tolerance: 1e-4 max |delta logprob| (measured ~1e-5) on a 32-token and a 700-token prompt (MSA keeps a
strict subset there).
Routing/block agreement is reported; with replay of the engine's choices it is 100%.
"""

import contextlib

import numpy as np
import pytest
import torch

from rl.model import ForwardStats, M3ForTraining, TrainerModelConfig
from rl.model.lora import adapter_state_dict, lora_parameters, peft_config, save_adapter
from tests.rollout.engine_fixtures import LONG, SHORT, prompt_ids


def randomize_lora(model, seed=0, std=0.02):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in lora_parameters(model):
            p.copy_(torch.randn(p.shape, generator=g) * std)


def trainer_logprobs(model, rollout, **replay):
    ids = rollout.prompt_ids + rollout.token_ids
    fed = torch.tensor(ids[:-1])
    cu = torch.tensor([0, len(fed)])
    s = ForwardStats()
    with torch.no_grad():
        lp = model.token_logprobs(fed, cu, torch.tensor(ids[1:]), stats=s, **replay)
    return lp, s


@pytest.fixture(scope="module", params=["quantized", "bf16"])
def setup(request):
    """The engine serves the quantized tiny M3 (NVFP4 experts, MXFP8 linears) and the trainer holds the same base
    in the same serving form; or both use the unquantized checkpoint."""
    from m3.tiny import ensure_tiny_model
    from rollout.engine import EngineConfig, RolloutEngine
    from tests.rollout.engine_fixtures import quantized_tiny_model

    paths = ensure_tiny_model(dtype="float32")
    served = quantized_tiny_model("float32") if request.param == "quantized" else paths.vllm
    engine = RolloutEngine(EngineConfig(model=str(served), dtype="float32", capture_blocks=True))
    model = M3ForTraining(TrainerModelConfig(path=str(served), dtype="float32", base=request.param))
    randomize_lora(model)
    info = engine.load_adapter(adapter_state_dict(model), peft_config(model.mcfg.lora))
    yield engine, model, paths, info
    engine.close()


@pytest.fixture(scope="module")
def rollouts(setup):
    engine = setup[0]
    return {n: engine.generate([prompt_ids(n, seed=40 + n)], temperature=1.0, seed=3, max_tokens=8,
                               ignore_eos=True, prompt_logprobs=True)[0][0] for n in (SHORT, LONG)}


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_trainer_logprobs_equal_engine_with_the_same_adapter(setup, rollouts, n):
    engine, model = setup[:2]
    r = rollouts[n]
    lp, stats = trainer_logprobs(model, r)
    engine_lp = torch.from_numpy(np.concatenate([r.prompt_logprobs, r.logprobs]))
    delta = (lp - engine_lp).abs()
    print(f"n={n}: max |delta| {delta.max():.2e}, routing agreement {stats.routing_agreement}, "
          f"block agreement {stats.block_agreement}")
    assert delta.max() <= 1e-4
    assert set(stats.routing_agreement) == {1, 2, 3} and set(stats.block_agreement) == {1, 2, 3}


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_replay_of_engine_choices_gives_full_agreement(setup, rollouts, n):
    model = setup[1]
    r = rollouts[n]
    lp, stats = trainer_logprobs(model, r, routing=r.routed_experts, blocks=r.block_ids)
    engine_lp = torch.from_numpy(np.concatenate([r.prompt_logprobs, r.logprobs]))
    assert (lp - engine_lp).abs().max() <= 1e-4
    assert all(v == 1.0 for v in stats.routing_agreement.values())
    assert all(v == 1.0 for v in stats.block_agreement.values())


def test_saved_adapter_is_peft_format_vllm_and_peft_load(setup, rollouts, tmp_path):
    engine, model, paths, info = setup
    from peft import PeftModel
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from tests.rollout.hf_reference import load_reference, teacher_forced

    out = save_adapter(model, model.mcfg.lora, tmp_path / "adapter", dtype=torch.float32)
    r = rollouts[SHORT]
    ids = r.prompt_ids
    res = engine.llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0),
                              lora_request=LoRARequest("saved", 5, str(out)), use_tqdm=False)[0]
    file_lp = torch.tensor([d[t].logprob for t, d in zip(ids[1:], res.prompt_logprobs[1:])])
    assert (file_lp - torch.from_numpy(r.prompt_logprobs)).abs().max() <= 1e-5  # vLLM: file == memory
    if model.mcfg.base == "bf16":  # transformers holds the unquantized weights: comparable on that base only
        peft_model = PeftModel.from_pretrained(load_reference(paths.hf), str(out))
        ref = teacher_forced(peft_model, ids).token_logprobs(ids)
        assert (ref - file_lp).abs().max() <= 1e-4  # peft reads the same adapter the same way


def test_only_lora_parameters_get_gradients(setup, rollouts):
    model = setup[1]
    r = rollouts[SHORT]
    ids = torch.tensor(r.prompt_ids + r.token_ids)
    model.zero_grad(set_to_none=True)
    lp = model.token_logprobs(ids[:-1], torch.tensor([0, len(ids) - 1]), ids[1:],
                              routing=r.routed_experts, blocks=r.block_ids)
    lp.sum().backward()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora" in n for n in trainable)
    # The indexer only selects blocks (a discrete top-k): its LoRA gets no gradient from a token loss.
    flows = {n: p.grad is not None and bool(p.grad.abs().sum() > 0) for n, p in model.named_parameters()
             if p.requires_grad}
    assert all(v for n, v in flows.items() if ".indexer." not in n)
    assert not any(v for n, v in flows.items() if ".indexer." in n)
    assert all(p.grad is None for n, p in model.named_parameters() if not p.requires_grad)
    model.zero_grad(set_to_none=True)


def test_activation_checkpointing_is_exact(setup, rollouts):
    """Recomputing every decoder layer (and the logprob chunks) in backward gives the same logprobs and gradients."""
    model = setup[1]
    r = rollouts[LONG]
    ids = torch.tensor(r.prompt_ids + r.token_ids)
    results = []
    for ckpt in (False, True):
        model.mcfg.activation_checkpointing = ckpt
        model.zero_grad(set_to_none=True)
        lp = model.token_logprobs(ids[:-1], torch.tensor([0, len(ids) - 1]), ids[1:])
        lp.sum().backward()
        results.append((lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    model.mcfg.activation_checkpointing = False
    model.zero_grad(set_to_none=True)
    (lp0, g0), (lp1, g1) = results
    assert torch.equal(lp0, lp1) and g0.keys() == g1.keys() and g0
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


@contextlib.contextmanager
def moe_chunks(model, chunk: int):
    """model.moe_chunk_tokens=chunk on the MoE layers inside the block; after it: no chunks, no recompute, no grads."""
    for layer in model.model.layers:
        if layer.is_moe:
            layer.mlp.chunk_tokens = chunk
    try:
        yield
    finally:
        model.mcfg.activation_checkpointing = False
        for layer in model.model.layers:
            if layer.is_moe:
                layer.mlp.chunk_tokens = 0
        model.zero_grad(set_to_none=True)


def lora_grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_moe_token_chunks_match_one_pass(setup, rollouts):
    """model.moe_chunk_tokens: routed experts per group of experts, each recomputed in backward; same results (up to
    the order of fp32 sums)."""
    model = setup[1]
    r = rollouts[LONG]
    ids = torch.tensor(r.prompt_ids + r.token_ids)
    results = []
    for chunk in (0, 97):
        with moe_chunks(model, chunk):
            lp = model.token_logprobs(ids[:-1], torch.tensor([0, len(ids) - 1]), ids[1:])
            lp.sum().backward()
            results.append((lp.detach(), lora_grads(model)))
    (lp0, g0), (lp1, g1) = results
    assert (lp0 - lp1).abs().max() <= 1e-5 and g0.keys() == g1.keys() and g0
    assert max(float((g0[n] - g1[n]).norm() / g0[n].norm().clamp_min(1e-30)) for n in g0) <= 1e-4


def test_activation_checkpointing_with_moe_chunks_is_exact(setup, rollouts):
    """With MoE chunks, activation checkpointing recomputes the attention half and the MoE's own expert groups
    (DecoderLayer checkpoint_parts), not the whole layer: still the same logprobs and gradients as no recompute."""
    model = setup[1]
    r = rollouts[LONG]
    ids = torch.tensor(r.prompt_ids + r.token_ids)
    results = []
    with moe_chunks(model, 97):
        for ckpt in (False, True):
            model.mcfg.activation_checkpointing = ckpt
            model.zero_grad(set_to_none=True)
            lp = model.token_logprobs(ids[:-1], torch.tensor([0, len(ids) - 1]), ids[1:])
            lp.sum().backward()
            results.append((lp.detach(), lora_grads(model)))
    (lp0, g0), (lp1, g1) = results
    assert torch.equal(lp0, lp1) and g0.keys() == g1.keys() and g0
    assert all(torch.equal(g0[n], g1[n]) for n in g0)


def test_attention_half_in_sequence_groups_is_exact(setup, rollouts):
    """Under recompute with MoE chunks the attention half runs one checkpoint per group of whole sequences of
    <= moe_chunk_tokens tokens: a packed batch split into two groups gives the logprobs and block agreement of no
    recompute, its gradients up to the order of fp32 sums, and replaying the choices of that pass is followed in
    every group."""
    model = setup[1]
    seqs = [rollouts[n].prompt_ids + rollouts[n].token_ids for n in (LONG, SHORT, LONG)]
    fed = torch.tensor([t for ids in seqs for t in ids[:-1]])
    targets = torch.tensor([t for ids in seqs for t in ids[1:]])
    cu = torch.tensor([0, *np.cumsum([len(ids) - 1 for ids in seqs]).tolist()])
    results = []
    with moe_chunks(model, int(cu[2])):  # groups: LONG + SHORT, then LONG
        for ckpt, replay in ((False, {}), (True, {}), (True, "replay")):
            model.mcfg.activation_checkpointing = ckpt
            model.zero_grad(set_to_none=True)
            stats = ForwardStats(keep_choices=not replay)
            if replay:
                routing, blocks = model.replay_arrays(results[0][2])
                replay = {"routing": routing, "blocks": blocks}
            lp = model.token_logprobs(fed, cu, targets, stats=stats, **replay)
            lp.sum().backward()
            results.append((lp.detach(), lora_grads(model), stats))
    (lp0, g0, s0), (lp1, g1, s1), (lp2, g2, s2) = results
    assert torch.equal(lp0, lp1) and g0.keys() == g1.keys() and g0
    # LoRA weight gradients sum over tokens: per group, then across groups (another fp32 order)
    rel = max(float((g0[n] - g1[n]).norm() / g0[n].norm().clamp_min(1e-30)) for n in g0)
    assert rel <= 1e-5, rel
    assert s0.block_agreement and s0.block_agreement.keys() == s1.block_agreement.keys()
    assert all(abs(s0.block_agreement[i] - s1.block_agreement[i]) <= 1e-6 for i in s0.block_agreement)
    assert s2.blocks_replayed and all(v == 1.0 for v in s2.blocks_replayed.values())
    assert torch.equal(lp0, lp2)  # the own choices, replayed: the same forward


def test_grouped_experts_need_cuda(setup):
    from rl.model import TrainerModelConfig

    with pytest.raises(ValueError, match="model.moe_impl"):
        TrainerModelConfig(path="x", moe_impl="fast").validate()
    moe = next(layer.mlp for layer in setup[1].model.layers if layer.is_moe)
    moe.impl = "grouped"
    try:
        with pytest.raises(ValueError, match="moe_impl='grouped' needs CUDA"):
            moe(torch.zeros(3, setup[1].config.hidden_size))
    finally:
        moe.impl = "auto"


@pytest.mark.parametrize("kind,message", [
    ("routing shape", "routing replay has shape"),
    ("routing range", "outside \\[0, 8\\)"),
    ("blocks beyond visible", "beyond|visible"),
])
def test_bad_replay_is_one_clear_error(setup, rollouts, kind, message):
    model = setup[1]
    r = rollouts[SHORT]
    routing, blocks = r.routed_experts.copy(), r.block_ids.copy()
    if kind == "routing shape":
        routing = routing[:-1]
    elif kind == "routing range":
        routing[3, 2, 0] = 9
    else:
        blocks[5, 0, 0, 0] = 7
    with pytest.raises(ValueError, match=message):
        trainer_logprobs(model, r, routing=routing, blocks=blocks)


def test_adapter_that_does_not_fit_is_one_clear_error(setup):
    from rl.model.lora import load_adapter_tensors

    model = setup[1]
    tensors = adapter_state_dict(model)
    key = next(k for k in tensors if "q_proj.lora_B" in k)
    tensors[key] = tensors[key][:-1]
    tensors["base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight"] = torch.zeros(32, 256)
    with pytest.raises(ValueError, match="(?s)unexpected tensor .*layers.9.*shape"):
        load_adapter_tensors(model, tensors)
