"""LoRA on the served M3, in-memory adapter sync with checksums, bad-adapter refusal, routing capture.

One fp32 engine serves the tiny M3 with LoRA on; the reference is transformers + peft with the same adapter
(rank 32 on every target: q/k/v/o, the indexer's q/k, dense and shared-expert MLPs, routed experts in peft's 3D
format). Tolerance for fp32: 1e-3 max |delta logprob| (measured ~1e-5).
"""

import numpy as np
import pytest

from rollout.adapter_sync import AdapterError, adapter_checksum, pack_adapter
from rollout.engine import ADAPTER_ID
from tests.rollout.engine_fixtures import LONG, SHORT, make_adapter, make_engine, prompt_ids, run_and_compare


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    engine, reference, _ = make_engine("float32", max_loras=2)
    adapter_dir = tmp_path_factory.mktemp("adapter")
    peft_model, tensors, cfg = make_adapter(reference, adapter_dir, seed=1)
    yield engine, peft_model, tensors, cfg, adapter_dir
    engine.close()


def sampled_logprobs(engine, ids, **kw):
    r = engine.generate([ids], n=1, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, **kw)[0][0]
    return r.token_ids, r.logprobs


def test_file_adapter_then_memory_adapter_identical_and_match_reference(served):
    engine, peft_model, tensors, cfg, adapter_dir = served
    from vllm.lora.request import LoRARequest

    ids = prompt_ids(SHORT, seed=3)
    out = engine.llm.generate([{"prompt_token_ids": ids}], _params(), use_tqdm=False,
                              lora_request=LoRARequest("file", 2, str(adapter_dir)))[0].outputs[0]
    file_lp = np.array([d[t].logprob for t, d in zip(out.token_ids, out.logprobs)], dtype=np.float32)
    info = engine.load_adapter(tensors, cfg)
    assert info["checksum"] == adapter_checksum(tensors)  # what the engine received is what was sent
    mem_tokens, mem_lp = sampled_logprobs(engine, ids)
    assert list(out.token_ids) == mem_tokens and np.array_equal(file_lp, mem_lp)


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_lora_logprobs_match_transformers_peft(served, n):
    engine, peft_model, tensors, cfg, _ = served
    engine.load_adapter(tensors, cfg)
    r = run_and_compare(engine, peft_model, prompt_ids(n, seed=n + 1), greedy=False)
    assert r["prompt_delta"].max() <= 1e-3 and r["new_delta"].max() <= 1e-3, (
        r["prompt_delta"].max(), r["new_delta"].max())
    with peft_model.disable_adapter():
        base = run_and_compare(engine, peft_model, prompt_ids(n, seed=n + 1), greedy=False)
    assert base["prompt_delta"].max() > 0.05  # the adapter really changes what the engine computes


def test_routing_capture_equals_reference_router(served):
    engine, peft_model, tensors, cfg, _ = served
    engine.load_adapter(tensors, cfg)
    r = run_and_compare(engine, peft_model, prompt_ids(300, seed=5), greedy=False)
    routed = r["rollout"].routed_experts
    assert routed.dtype == np.uint8 and routed.shape == (r["rows"], 4, 2)
    assert (routed[:, 0] == 255).all()  # layer 0 is dense: marked
    for layer in (1, 2, 3):
        ref = r["ref"].routing[layer][: r["rows"]]
        engine_sets = [set(row) for row in routed[:, layer].tolist()]
        assert engine_sets == [set(row) for row in ref.tolist()], f"layer {layer}"


def _params():
    from vllm import SamplingParams

    return SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=0)


def _bad(tensors, cfg, kind):
    t = dict(tensors)
    cfg = dict(cfg)
    if kind == "unknown module":
        key = next(k for k in t if ".layers.1.self_attn.o_proj.lora_A" in k)
        t[key.replace(".layers.1.", ".layers.9.")] = t.pop(key)
    elif kind == "wrong shape":
        key = next(k for k in t if ".layers.1.self_attn.q_proj.lora_B" in k)
        t[key] = t[key][:-8]
    elif kind == "rank above max":
        cfg["r"] = 64
        t = {k: (v.repeat(2, 1) if "lora_A" in k else v.repeat(1, 2)) for k, v in t.items()}
    elif kind == "corrupted in transit":
        return t, cfg, "corrupt"
    return t, cfg, None


@pytest.mark.parametrize("kind,message", [
    ("unknown module", "no such LoRA module"),
    ("wrong shape", "shape"),
    ("rank above max", "max_lora_rank|rank"),
    ("corrupted in transit", "corrupted in transit"),
])
def test_bad_adapter_is_refused_and_previous_adapter_keeps_serving(served, kind, message):
    engine, _, tensors, cfg, _ = served
    engine.load_adapter(tensors, cfg)
    ids = prompt_ids(SHORT, seed=11)
    before = sampled_logprobs(engine, ids)
    bad, bad_cfg, mode = _bad(tensors, cfg, kind)
    with pytest.raises(AdapterError, match=message):
        if mode == "corrupt":
            blob = bytearray(pack_adapter(bad))
            blob[-5] ^= 0x40  # flip one bit of the last tensor's data
            engine.llm.collective_rpc("m3_install_adapter", args=(bytes(blob), cfg, ADAPTER_ID,
                                                                  adapter_checksum(bad)))
        else:
            engine.load_adapter(bad, bad_cfg)
    after = sampled_logprobs(engine, ids)
    assert before[0] == after[0] and np.array_equal(before[1], after[1])


def test_nan_adapter_never_reaches_the_engine(served):
    engine, _, tensors, cfg, _ = served
    bad = dict(tensors)
    key = next(iter(bad))
    bad[key] = bad[key].clone()
    bad[key][0, 0] = float("nan")
    with pytest.raises(AdapterError, match="NaN/Inf"):
        engine.load_adapter(bad, cfg)


def test_sync_raises_when_an_installed_buffer_differs_from_the_sent_adapter(served):
    """The per-sync installed == held comparison runs in the worker: a fault in vLLM's packing (here: one value of
    one slice changed as the adapter is activated) stops the sync, naming the module and buffer."""
    engine, _, tensors, cfg, _ = served
    target = "model.layers.1.self_attn.o_proj"

    def inject(worker):
        am = worker.model_runner.lora_manager._adapter_manager
        activate = am.activate_adapter

        def faulty_activate(lora_id):
            ok = activate(lora_id)
            am.modules[target].lora_a_stacked[0][am.lora_index_to_id.index(lora_id), 0, 2, 7] += 1e-3
            return ok

        am.activate_adapter = faulty_activate
        return activate

    originals = engine.llm.collective_rpc(inject)
    try:
        with pytest.raises(AdapterError, match=rf"worker 0: {target}\|lora_a_stacked\|0: 1 values differ"):
            engine.load_adapter(tensors, cfg)
    finally:
        def restore(worker):
            worker.model_runner.lora_manager._adapter_manager.activate_adapter = originals[0]
        engine.llm.collective_rpc(restore)
    info = engine.load_adapter(tensors, cfg)  # the next clean sync installs and verifies
    assert info["verify_ms"] > 0 and info["workers"] == 1


def test_sync_verify_follows_a_reallocated_lora_buffer(served):
    """The worker reuses its views of the LoRA buffers across syncs; once a module holds a new buffer, the check
    must read that one (a stale view would still hold the previous adapter's values and fail this sync)."""
    engine, _, tensors, cfg, _ = served
    target = "model.layers.1.self_attn.o_proj"
    engine.load_adapter(tensors, cfg)  # the views are built

    def reallocate(worker):
        module = worker.model_runner.lora_manager._adapter_manager.modules[target]
        old = module.lora_a_stacked
        module.lora_a_stacked = tuple(t.clone() for t in old)
        return old

    def restore(worker, old):
        worker.model_runner.lora_manager._adapter_manager.modules[target].lora_a_stacked = old

    originals = engine.llm.collective_rpc(reallocate)
    try:
        info = engine.load_adapter({k: v * 2 for k, v in tensors.items()}, cfg)
        assert info["workers"] == 1 and info["verify_ms"] > 0
    finally:
        engine.llm.collective_rpc(restore, args=(originals[0],))
    engine.load_adapter(tensors, cfg)
