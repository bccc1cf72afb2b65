"""Shared pieces of the engine tests: deterministic prompts, engines on the tiny model, the comparison."""

import json
from pathlib import Path

import torch

from m3.tiny import ensure_tiny_model
from rollout.engine import EngineConfig, RolloutEngine
from tests.rollout.hf_reference import block_sets, load_reference, teacher_forced

SHORT, LONG, NEW_TOKENS, BLOCK = 32, 700, 8, 128


def prompt_ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 500, (n,), generator=g).tolist()  # ordinary (non-special) tokens of the 512 vocab


def make_engine(dtype: str = "float32", **overrides):
    paths = ensure_tiny_model(dtype=dtype)
    cfg = EngineConfig(model=str(paths.vllm), dtype=dtype, capture_blocks=True, **overrides)
    return RolloutEngine(cfg), load_reference(paths.hf), paths


def run_and_compare(engine: RolloutEngine, reference, ids: list[int], greedy: bool = True, **mode) -> dict:
    """Generate from `ids`, then teacher-force the same tokens through the reference; return the differences."""
    r = engine.generate([ids], n=1, temperature=0.0 if greedy else 1.0, seed=0, max_tokens=NEW_TOKENS,
                        ignore_eos=True, prompt_logprobs=True)[0][0]
    full = ids + r.token_ids
    ref = teacher_forced(reference, full, **mode)
    token_lp = ref.token_logprobs(full)
    n = len(ids)
    fed = full[:-1]  # the engine never feeds the last sampled token back
    return {
        "rollout": r,
        "ref": ref,
        "ref_greedy": ref.logprobs[n - 1:len(full) - 1].argmax(-1).tolist(),
        "prompt_delta": (torch.from_numpy(r.prompt_logprobs) - token_lp[: n - 1]).abs(),
        "new_delta": (torch.from_numpy(r.logprobs) - token_lp[n - 1:]).abs(),
        "rows": len(fed),
    }


def block_agreement(result: dict, sparse_layers: list[int]) -> float:
    """Fraction of (sparse layer, query) pairs whose engine block sets equal the reference indexer's."""
    blocks = result["rollout"].block_ids  # [rows, L_sparse, H, topk]
    pairs = [(block_sets(torch.from_numpy(blocks[pos, j]).long()), block_sets(result["ref"].blocks[layer][:, pos]))
             for j, layer in enumerate(sparse_layers) for pos in range(result["rows"])]
    return sum(a == b for a, b in pairs) / len(pairs)


def quantized_tiny_model(dtype: str = "float32"):
    """The tiny M3 converted by quant.convert (NVFP4 experts, MXFP8 linears), cached beside the bf16 copy."""
    from quant.convert import quantize_checkpoint

    paths = ensure_tiny_model(dtype=dtype)
    out = paths.vllm.with_name(paths.vllm.name + "-quantized")
    if not (out / "config.json").is_file():
        import shutil
        import tempfile

        tmp = Path(tempfile.mkdtemp(prefix=".quantized-", dir=out.parent))
        quantize_checkpoint(paths.vllm, tmp / "q")
        shutil.rmtree(out, ignore_errors=True)
        (tmp / "q").rename(out)
        tmp.rmdir()
    return out


def make_adapter(reference, out_dir, seed: int):
    """A random (non-zero B) rank-32 peft adapter on every target of the reference model (q/k/v/o, the indexer's
    q/k, dense and shared-expert MLPs, routed experts in peft's 3D format), saved as peft does."""
    from peft import LoraConfig, get_peft_model
    from safetensors.torch import load_file

    cfg = LoraConfig(r=32, lora_alpha=64, init_lora_weights=False,
                     target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
                     target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    model = get_peft_model(reference, cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    model.save_pretrained(out_dir)
    return model, load_file(f"{out_dir}/adapter_model.safetensors"), json.load(open(f"{out_dir}/adapter_config.json"))


def assert_within_bf16_bounds(result: dict, bounds: tuple, sparse_layers: list[int], label: str) -> None:
    """bf16 engine vs an fp32 reference: (median, mean) of prompt-logprob |delta|, max over generated tokens, and
    the minimum MSA block agreement."""
    median, mean, new_max, agreement = bounds
    d = result["prompt_delta"]
    agree = block_agreement(result, sparse_layers)
    print(f"{label}: median {d.median():.3g} mean {d.mean():.3g} max {d.max():.3g} "
          f"generated max {result['new_delta'].max():.3g} block agreement {agree:.4f}")
    assert d.median() <= median and d.mean() <= mean
    assert result["new_delta"].max() <= new_max
    assert agree >= agreement
