"""`python -m rl.check`: the three trainer/engine agreements on a fixed batch, as one JSON object.

weights: the adapter the engine installed has the trainer's checksum, and both load the same checkpoint files;
agreement: the trainer's own expert / MSA block choices vs the engine's captured ones, and under replay the
  fraction of rows where the forward used the engine's choice (1.0 when replay works);
logprobs: mean/max |delta| and KL(rollout || train) with the k3 estimator over the sampled tokens.
Each failure is named in `failures`; non-zero exit when there is one. Also run at step 0 of training.
"""

import json
import os
import sys
from pathlib import Path

import hydra
import numpy as np
import torch

from quant.checkpoint import QuantizedCheckpoint
from rl.agreement import engine_agreement
from rl.algorithm import train_rollout_kl
from rl.attribution import attribute, print_table
from rl.batch import pack_rollouts
from rl.config import register
from rl.eval import load_adapter_files
from rl.model import ForwardStats
from rl.model.lora import load_adapter_tensors
from rl.session import Session
from rollout.adapter_sync import adapter_checksum

register()


# Gates by model dtype (check.* = null picks these), from results/check_embedded_default.json (the embedded default
# with the 40-step run's adapter, CPU engine, 256 response tokens): fp32 mean |dlogprob| 4e-7, KL(k3) 1.4e-12; bf16
# mean |dlogprob| 1.6e-4, KL 1.4e-6 (3e-7 with the NVFP4 KV cache, 2.9e-6 with a fresh adapter); expert choices
# >= 0.999 equal in bf16 (near ties), 1.0 in fp32. The bf16 KL gate sits between that and the smallest removed source
# (the plain-dequantized base, KL 1.6e-5).
GATES = {"float32": {"max_mean_abs_logprob_diff": 1e-4, "max_kl": 1e-6, "min_agreement": 1.0},
         "bfloat16": {"max_mean_abs_logprob_diff": 1e-3, "max_kl": 1e-5, "min_agreement": 0.99}}


def setup_mismatches(engine_cfg, model_cfg) -> list[str]:
    """What the engine serves vs what the trainer holds, from their configurations: a difference here explains a
    logprob gap before any number is compared."""
    out = []
    served, held = Path(engine_cfg.model).resolve(), Path(model_cfg.path).resolve()
    if served != held:
        out.append(f"checkpoint: the engine serves {served}, the trainer loaded {held}")
    quantized = QuantizedCheckpoint(served).scheme is not None
    if quantized != (model_cfg.base == "quantized"):
        out.append("base: the engine serves a " + ("quantized checkpoint (NVFP4 experts, MXFP8 projections) but the "
                   "trainer holds the bf16 base (model.base=bf16)" if quantized else "bf16 checkpoint but the trainer "
                   "quantizes it (model.base=quantized)"))
    for key in ("dtype", "kv_cache_dtype", "indexer_kv_dtype"):
        if str(getattr(engine_cfg, key)) != str(getattr(model_cfg, key)):
            out.append(f"{key}: the engine runs {getattr(engine_cfg, key)!r}, the trainer {getattr(model_cfg, key)!r}"
                       + (" (its K/V QDQ)" if "kv" in key else ""))
    return out


def run_check(engine, model, prompt_ids: list[list[int]], cfg, adapter_tensors, peft_cfg, max_tokens: int) -> dict:
    """Compare the adapter the engine holds with the trainer's (`adapter_tensors`), then sample one response per
    prompt and compare the trainer's forward over the same tokens with the engine's: without replay (the trainer's
    own routing and blocks) and with the configured replay. Installs nothing: sync before."""
    weights = engine.verify_adapter(adapter_tensors, peft_cfg)
    rollouts = [g[0] for g in engine.generate(prompt_ids, n=1, temperature=1.0, max_tokens=max_tokens,
                                               seed=cfg.trainer.seed, ignore_eos=True)]
    batch = pack_rollouts(rollouts)
    result = {"weights_exact": weights["installed_equals_held"], "weights": weights,
              "adapter_checksum": adapter_checksum(adapter_tensors), "checkpoint": engine.cfg.model}
    replay = {"routing": cfg.actor.routing_replay, "blocks": cfg.actor.block_replay}
    for mode, on in (("without_replay", {"routing": False, "blocks": False}), ("with_replay", replay)):
        stats = ForwardStats(keep_choices=True)
        with torch.no_grad():
            lp = model.token_logprobs(batch.input_ids, batch.cu_seqlens, batch.targets, stats=stats,
                                      routing=batch.routing if on["routing"] else None,
                                      blocks=batch.blocks if on["blocks"] else None)
        kl = train_rollout_kl(lp, batch.rollout_logprobs, batch.response_mask)
        result.setdefault("logprobs", {})[mode] = {k: kl[k] for k in ("logprob_abs_diff_mean", "logprob_abs_diff_max",
                                                                       "kl_k3", "kl_k1")}
        result.setdefault("agreement", {})[mode] = engine_agreement(model, stats, batch, on)
        if mode == "with_replay":  # the choice the forward used vs the engine's: 1.0 whenever replay works
            used = {"routing": stats.routing_replayed, "blocks": stats.blocks_replayed}
            result["replayed"] = {k: float(np.mean(list(used[k].values()))) if used[k] else None
                                  for k, v in on.items() if v}
    gates = {k: v if cfg.check[k] is None else cfg.check[k] for k, v in GATES[str(cfg.model.dtype)].items()}
    result["kl_estimator"] = "k3: E[r - 1 - log r], r = pi_train / pi_rollout over sampled tokens"
    result["thresholds"] = {**gates, "min_replayed_agreement": cfg.check.min_replayed_agreement}
    result["setup"] = setup_mismatches(engine.cfg, model.mcfg)
    result["failures"] = failures = result["setup"] + _failures(result, gates, cfg.check.min_replayed_agreement,
                                                                replay)
    if cfg.check.attribution:
        result["attribution"] = attribute(model, batch, replay, adapter_tensors)
    result["passed"] = not failures
    return result


def _failures(result: dict, gates: dict, min_replayed: float, replay: dict) -> list[str]:
    """Each failed agreement, named by its source."""
    out = [f"weights: {m}" for m in result["weights"]["mismatches"][:20]]
    if not result["weights_exact"] and not out:
        out.append("weights: the adapter the engine holds differs from the trainer's")
    lp = result["logprobs"]["with_replay"]
    if not lp["kl_k3"] <= gates["max_kl"]:  # `not <=`: NaN fails too
        out.append(f"logprobs: KL(k3) {lp['kl_k3']:.3g} > {gates['max_kl']:.3g}")
    if not lp["logprob_abs_diff_mean"] <= gates["max_mean_abs_logprob_diff"]:
        out.append(f"logprobs: mean |dlogprob| {lp['logprob_abs_diff_mean']:.3g} > "
                   f"{gates['max_mean_abs_logprob_diff']:.3g}")
    for key, on in replay.items():
        got = result["replayed"].get(key) if on else None
        if on and (got is None or not got >= min_replayed):
            out.append(f"{key}: replay used the engine's choice for {got} of the rows (< {min_replayed})")
    for key, own in result["agreement"]["with_replay"].items():  # near-ties aside, the trainer chooses as the engine
        if not own >= gates["min_agreement"]:
            out.append(f"{key}: the trainer's own choice equals the engine's captured one for {own:.4f} of the rows "
                       f"(< {gates['min_agreement']})")
    return out


def check_session(s: Session) -> dict:
    """`run_check` on a session's engine (synced before) and model, on the first eval prompts."""
    tensors, peft_cfg = s.adapter()
    prompts = s.eval_prompts[:s.cfg.check.batch_prompts]
    return run_check(s.engine, s.model, prompts, s.cfg, tensors, peft_cfg, s.cfg.data.max_response_length)


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def main(cfg) -> None:
    """Same configuration as rl.train (Hydra): builds the engine and trainer, runs the check, prints JSON."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout carries the one JSON object
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    with Session(cfg) as s:
        if cfg.check.adapter:  # a trained adapter: LoRA precision then matters, unlike at step 0 (B = 0)
            load_adapter_tensors(s.model, load_adapter_files(cfg.check.adapter)[0])
        s.sync_adapter()
        result = check_session(s)
    if "attribution" in result:
        print_table(result["attribution"])
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
