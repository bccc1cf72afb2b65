"""NVFP4 KV cache on the portable path: the engine stores K, V and index keys exactly as the SM100 writer
reconstructs them, so engine logprobs equal a reference that applies the same QDQ. Other models are refused."""

import pytest

from tests.rollout.engine_fixtures import LONG, SHORT, make_engine, prompt_ids, run_and_compare


@pytest.fixture(scope="module")
def nvfp4_results():
    engine, reference, _ = make_engine("float32", enable_lora=False, kv_cache_dtype="nvfp4",
                                       indexer_kv_dtype="nvfp4")
    out = {}
    for n in (SHORT, LONG):
        ids = prompt_ids(n, seed=n + 2)
        out[n] = run_and_compare(engine, reference, ids, kv_nvfp4=True, index_k_nvfp4=True)
        out[n, "plain"] = run_and_compare(engine, reference, ids)  # reference without the cache QDQ
    engine.close()
    return out


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_engine_equals_reference_with_the_same_kv_qdq(nvfp4_results, n):
    r, plain = nvfp4_results[n], nvfp4_results[n, "plain"]
    d = r["prompt_delta"]
    print(f"n={n}: median {d.median():.2e} p99 {d.quantile(0.99):.2e} max {d.max():.2e} new {r['new_delta'].max():.2e}"
          f" | without QDQ: median {plain['prompt_delta'].median():.2e} max {plain['prompt_delta'].max():.2e}")
    # The QDQ is a rounding: a ~1e-7 difference in K (fp32 accumulation order) can move a value across an E2M1
    # rounding boundary and change the stored value by a full step. Such flips are rare and isolated.
    assert d.median() <= 1e-4 and d.quantile(0.99) <= 2e-3 and d.max() <= 5e-3
    assert r["new_delta"].max() <= 1e-3
    assert plain["prompt_delta"].median() > 100 * d.median()  # the QDQ is really applied


def test_nvfp4_kv_cache_for_other_models_is_a_clear_error(tmp_path):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from vllm import LLM

    from m3.tiny import ensure_tiny_model

    Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1, head_dim=32)).save_pretrained(tmp_path)
    tokenizer_dir = ensure_tiny_model(dtype="float32").vllm
    with pytest.raises(ValueError, match="kv_cache_dtype='nvfp4' is not supported by vLLM's CPU attention"):
        LLM(model=str(tmp_path), tokenizer=str(tokenizer_dir), kv_cache_dtype="nvfp4", enforce_eager=True,
            kv_cache_memory_bytes=16 << 20, distributed_executor_backend="uni")
