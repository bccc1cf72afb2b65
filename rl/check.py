"""`python -m rl.check`: the three trainer/engine agreements on a fixed batch, as one JSON object.

weights: the adapter the engine installed has the trainer's checksum, and both load the same checkpoint files;
routing: expert agreement of the trainer's own router with the engine's choices (and 100% with replay);
logprobs: mean/max |delta| and KL(rollout || train) with the k3 estimator over the sampled tokens.
Non-zero exit when a configured threshold is exceeded. Also run at step 0 of training.
"""

import json
import sys

import hydra
import numpy as np
import torch

from rl.algorithm import train_rollout_kl
from rl.batch import pack_rollouts
from rl.config import register
from rl.model import ForwardStats
from rl.session import Session
from rollout.adapter_sync import adapter_checksum

register()


def run_check(engine, model, prompt_ids: list[list[int]], cfg, adapter_tensors, peft_cfg, max_tokens: int) -> dict:
    sync = engine.load_adapter(adapter_tensors, peft_cfg)
    rollouts = [g[0] for g in engine.generate(prompt_ids, n=1, temperature=1.0, max_tokens=max_tokens,
                                               seed=cfg.trainer.seed, ignore_eos=True)]
    batch = pack_rollouts(rollouts)
    result = {"weights_exact": sync["checksum"] == adapter_checksum(adapter_tensors),
              "adapter_checksum": sync["checksum"], "checkpoint": engine.cfg.model}
    mean = lambda d: float(np.mean(list(d.values()))) if d else None  # noqa: E731
    runs = {}
    for mode, replay in (("without_replay", {}), ("with_replay", {
            "routing": batch.routing, "blocks": batch.blocks if cfg.actor.block_replay else None})):
        stats = ForwardStats()
        with torch.no_grad():
            lp = model.token_logprobs(batch.input_ids, batch.cu_seqlens, batch.targets, stats=stats, **replay)
        runs[mode] = stats
        kl = train_rollout_kl(lp, batch.rollout_logprobs, batch.response_mask)
        result.setdefault("logprobs", {})[mode] = {k: kl[k] for k in ("logprob_abs_diff_mean", "logprob_abs_diff_max",
                                                                       "kl_k3", "kl_k1")}
    # The trainer's own top-k vs the engine's choice, layer by layer on the same inputs (the replay forward), and
    # the choice actually used under replay vs the engine's.
    replayed = runs["with_replay"]
    result["routing_agreement"] = {"without_replay": mean(replayed.routing_agreement),
                                   "with_replay": mean(replayed.routing_replayed)}
    result["block_agreement"] = {"without_replay": mean(replayed.block_agreement) if cfg.actor.block_replay else
                                 None, "with_replay": mean(replayed.blocks_replayed)}
    c = cfg.check
    result["kl_estimator"] = "k3: E[r - 1 - log r], r = pi_train / pi_rollout over sampled tokens"
    result["thresholds"] = {"max_kl": c.max_kl, "max_mean_abs_logprob_diff": c.max_mean_abs_logprob_diff,
                            "min_routing_agreement_with_replay": c.min_routing_agreement_with_replay}
    with_replay = result["logprobs"]["with_replay"]
    result["passed"] = bool(result["weights_exact"] and with_replay["kl_k3"] <= c.max_kl
                            and with_replay["logprob_abs_diff_mean"] <= c.max_mean_abs_logprob_diff
                            and (result["routing_agreement"]["with_replay"] or 1.0)
                            >= c.min_routing_agreement_with_replay)
    return result


def check_session(s: Session) -> dict:
    """`run_check` on a session's engine and model with its current adapter, on the first eval prompts."""
    tensors, peft_cfg = s.adapter()
    prompts = s.eval_prompts[:s.cfg.check.batch_prompts]
    return run_check(s.engine, s.model, prompts, s.cfg, tensors, peft_cfg, s.cfg.data.max_response_length)


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def main(cfg) -> None:
    """Same configuration as rl.train (Hydra): builds the engine and trainer, runs the check, prints JSON."""
    with Session(cfg) as s:
        result = check_session(s)
    print(json.dumps(result, indent=2))
    sys.exit(0 if result["passed"] else 1)


if __name__ == "__main__":
    main()
