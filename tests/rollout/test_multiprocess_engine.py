"""The same engine client with vLLM's default multiprocess engine (EngineCore + worker in other processes):
the plugin loads there through the entry point, adapters travel as one safetensors blob, capture comes back."""

import numpy as np
import pytest

from tests.rollout.engine_fixtures import SHORT, make_adapter, make_engine, prompt_ids, run_and_compare


@pytest.fixture(scope="module")
def mp_engine(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    engine, reference, _ = make_engine("float32")
    assert not engine.in_process
    yield engine, reference, tmp_path_factory.mktemp("adapter")
    engine.close()
    mp.undo()


def test_multiprocess_adapter_sync_and_capture(mp_engine):
    engine, reference, adapter_dir = mp_engine
    peft_model, tensors, cfg = make_adapter(reference, adapter_dir, seed=2)
    info = engine.load_adapter(tensors, cfg)
    assert info["bytes"] > 0 and info["workers"] == 1
    r = run_and_compare(engine, peft_model, prompt_ids(SHORT, seed=21), greedy=False)
    assert r["prompt_delta"].max() <= 1e-3 and r["new_delta"].max() <= 1e-3
    rollout = r["rollout"]
    assert rollout.routed_experts.shape == (r["rows"], 4, 2) and rollout.routed_experts.dtype == np.uint8
    assert rollout.block_ids.shape == (r["rows"], 3, 1, 2)
