"""`python -m rl.train`: GRPO with token-level TIS (cap 2) on a LoRA adapter over the engine's exact base.

Single controller; one step is the stages below, in order:
  generate   n responses per prompt with the current adapter (rollout logprobs, routed experts, MSA blocks);
             then the engine sleeps when rollout.free_cache_engine is on
  score      rewards (verl's scorers, by data source)
  advantages GRPO (verl), per group of n
  forward    the trainer's logprobs of the same tokens, replaying the engine's experts (and blocks), then the
             backward of the token-TIS loss with the rollout logprobs as the old logprobs (verl's bypass mode); per
             micro-batch (actor.ppo_micro_batch_size_per_gpu sequences, or actor.use_dynamic_bsz: up to
             actor.ppo_max_token_len_per_gpu tokens) when set, gradients accumulating
  update     one optimizer step
  sync       wakes the engine; only the adapter, in memory, to the engine (checksum compared, each TP shard
             verified)
  log        one console line; every metric to metrics.jsonl and W&B
With no arguments it runs the embedded default (tiny M3 on the addition task). Run setup is rl/session.py.
"""

import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass

import hydra
import numpy as np
import torch
from omegaconf import OmegaConf

from rl.agreement import engine_agreement
from rl.algorithm import compute_advantages, global_batch_info, policy_loss, train_rollout_kl
from rl.batch import PackedBatch, pack_rollouts
from rl.check import check_session
from rl.plan import plan
from rl.config import register
from rl.metrics import MetricsLogger
from rl.model import ForwardStats
from rl.model.fsdp import full_adapter_state_dict
from rl.model.lora import write_adapter
from rl.rewards import compute_score
from rl.heap import freeze_heap
from rl.session import Session

register()


@dataclass
class Scored:
    rollouts: list  # flat, group after group
    rewards: list[float]
    accs: list[float]
    group_ids: list[int]
    texts: list[str]  # decoded responses
    prompts: list[str]  # each response's prompt (last message)


def generate(s: Session, step: int) -> tuple[list[int], list]:
    """This rank's share of the step's prompts, and n rollouts for each. Each engine replica generates its share
    (every rank of a tensor-parallel engine makes the same call and gets the same rollouts); its ranks then train
    on disjoint parts of it, so the ranks' parts cover the batch once."""
    c = s.cfg
    idx, prompts = s.train_prompts.draw(s.cursor, c.data.train_batch_size)  # every rank draws the same batch
    s.data_stats["dropped_overlong"] = s.train_prompts.n_too_long  # train prompts found too long so far
    idx, prompts = idx[s.replica::s.replicas], prompts[s.replica::s.replicas]
    groups = s.engine_call("generate", lambda engine: engine.generate(
        prompts, n=c.rollout.n, temperature=c.rollout.temperature, top_p=c.rollout.top_p,
        max_tokens=c.data.max_response_length, stop_token_ids=s.eos, seed=c.trainer.seed * 100003 + step))
    s.check_engine_group_agrees(hashlib.sha256(repr([[r.token_ids for r in g] for g in groups]).encode()).hexdigest(),
                                "rollouts")
    s.engine.sleep()  # free_cache_engine: the trainer gets the memory until the sync wakes the engine
    return idx[s.tp_rank::s.tp], groups[s.tp_rank::s.tp]


def score(s: Session, idx: list[int], groups: list) -> Scored:
    out = Scored([], [], [], [], [], [])
    for g, (i, group) in enumerate(zip(idx, groups)):
        row = s.train_rows[i]
        for r in group:
            text = s.tokenizer.decode(r.token_ids, skip_special_tokens=True)
            result = compute_score(row["data_source"], text, row["reward_model"]["ground_truth"])
            out.rollouts.append(r)
            out.rewards.append(float(result["score"]))
            out.accs.append(float(result["acc"]))
            out.group_ids.append(g)
            out.texts.append(text)
            out.prompts.append(row["prompt"][-1]["content"])
    return out


def forward(s: Session, batch: PackedBatch, width: int) -> tuple[torch.Tensor, dict]:
    """[B, width] trainer logprobs of the response tokens (as `PackedBatch.to_matrix` lays them out), the engine's
    choices replayed as configured; the trainer's own choices' agreement with the engine's."""
    replay = {"routing": s.cfg.actor.routing_replay, "blocks": s.cfg.actor.block_replay}
    stats = ForwardStats(keep_choices=not all(replay.values()))  # own choices kept only where not replayed
    logprobs = s.model.token_logprobs(batch.input_ids, batch.cu_seqlens, batch.targets, stats=stats,
                                      routing=batch.routing if replay["routing"] else None,
                                      blocks=batch.blocks if replay["blocks"] else None)
    return batch.to_matrix(logprobs, width)[0], engine_agreement(s.model, stats, batch, replay)


def advantages(s: Session, scored: Scored, mask: torch.Tensor) -> torch.Tensor:
    return compute_advantages(torch.tensor(scored.rewards), mask, np.array(scored.group_ids), s.cfg.algorithm)


def batch_info(s: Session, mask: torch.Tensor) -> dict:
    # FSDP averages gradients over ranks; verl's agg_loss scales by dp_size and the global counts to undo it, and
    # the same global counts make each micro-batch's loss its share of the step's loss
    return global_batch_info(mask, s.world, torch.distributed.all_reduce if s.world > 1 else None)


def loss_of(s: Session, lp, old_lp, adv, mask, info: dict) -> tuple[torch.Tensor, dict]:
    return policy_loss(lp, old_lp, adv, mask, s.cfg.algorithm, s.cfg.actor, info)


def micro_batches(s: Session, lengths: list[int]) -> list[tuple[int, int, float]]:
    """This rank's sequences (their token counts) as (start, end, weight) spans, in order: at most
    actor.ppo_micro_batch_size_per_gpu sequences each, or with actor.use_dynamic_bsz at most
    actor.ppo_max_token_len_per_gpu tokens each; one span when neither is set. Every rank runs as many spans as the
    rank that needs the most (under FSDP each forward and backward is collective): a rank with fewer splits its
    largest span in two until it has as many, and once every span is one sequence runs its first again at weight 0
    (no gradient)."""
    actor, n = s.cfg.actor, len(lengths)
    if actor.use_dynamic_bsz:
        spans, start, used = [], 0, 0
        for i, tokens in enumerate(lengths):
            if i > start and used + tokens > actor.ppo_max_token_len_per_gpu:
                spans.append((start, i))
                start, used = i, 0
            used += tokens
        spans.append((start, n))
    elif actor.ppo_micro_batch_size_per_gpu is not None:
        size = actor.ppo_micro_batch_size_per_gpu
        spans = [(i, min(i + size, n)) for i in range(0, n, size)]
    else:
        return [(0, n, 1.0)]
    count = max(s.all_gather(len(spans)))
    while len(spans) < count and any(b - a > 1 for a, b in spans):
        i = max((j for j, (a, b) in enumerate(spans) if b - a > 1), key=lambda j: sum(lengths[slice(*spans[j])]))
        a, b = spans[i]
        spans[i:i + 1] = [(a, (a + b) // 2), ((a + b) // 2, b)]
    return [(a, b, 1.0) for a, b in spans] + [(0, 1, 0.0)] * (count - len(spans))


def forward_backward(s: Session, batch: PackedBatch, old_lp: torch.Tensor, mask: torch.Tensor, adv: torch.Tensor,
                     info: dict) -> tuple[torch.Tensor, dict, bool, int]:
    """Each micro-batch's forward, then its loss's backward (gradients accumulate into the one step); old_lp, mask
    and adv: the whole batch's [B, L] matrices, sliced per micro-batch. -> the trainer's logprobs [B, L] (detached),
    the agreement with the engine (token-weighted), whether every loss was finite on every rank, and the number of
    passes. From a non-finite loss on, the rest run forward only (for the step's metrics) and the gradients are
    cleared: no rank steps."""
    s.optimizer.zero_grad(set_to_none=True)
    finite, lps, agreements = True, [], []
    spans = micro_batches(s, torch.diff(batch.cu_seqlens).tolist())
    for a, b, weight in spans:
        part = batch.select(a, b)
        with torch.set_grad_enabled(finite):
            lp, agreement = forward(s, part, adv.shape[1])
        if finite:
            loss, _ = loss_of(s, lp, old_lp[a:b], adv[a:b], mask[a:b], info)
            finite = s.all_ranks(bool(torch.isfinite(loss)))  # backward is collective under FSDP: all ranks or none
            if finite:
                (loss * weight).backward()
        if weight:
            lps.append(lp.detach())
            agreements.append((len(part.input_ids), agreement))
    if not finite:
        s.optimizer.zero_grad(set_to_none=True)
    tokens = sum(t for t, _ in agreements)
    agreement = {k: sum(t * a[k] for t, a in agreements) / tokens for k in agreements[0][1]}
    return torch.cat(lps), agreement, finite, len(spans)


def update(s: Session) -> float | None:
    """One optimizer step on the accumulated gradients; None (and no step) when their norm is not finite."""
    grad_norm = torch.nn.utils.clip_grad_norm_(s.params, s.cfg.actor.optim.grad_clip)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    if not s.all_ranks(bool(torch.isfinite(grad_norm))):
        s.optimizer.zero_grad(set_to_none=True)
        return None
    s.optimizer.step()
    s.scheduler.step()
    return float(grad_norm)


def step_metrics(s: Session, scored: Scored, loss, loss_metrics: dict, kl: dict, agreement: dict) -> dict:
    rewards = [x for part in s.all_gather(scored.rewards) for x in part]
    accs = [x for part in s.all_gather(scored.accs) for x in part]
    by_group = {}
    for g, r in zip(scored.group_ids, scored.rewards):
        by_group.setdefault(g, set()).add(r)
    metrics = {"reward/mean": float(np.mean(rewards)), "reward/acc": float(np.mean(accs)),
               "response/length": float(np.mean([len(r.token_ids) for r in scored.rollouts])),
               "train/loss": loss.item(), **{f"train_rollout/{k}": v for k, v in kl.items() if "/" not in k},
               # verl's IS metrics of the loss (weights after the cap; capped = raw ratio above the threshold)
               "is/ratio_mean": loss_metrics.get("rollout_corr/rollout_is_mean", math.nan),
               "is/ratio_max": loss_metrics.get("rollout_corr/rollout_is_max", math.nan),
               "is/capped_frac": loss_metrics.get("rollout_corr/rollout_is_ratio_fraction_high", math.nan),
               **{f"agreement/{k}": v for k, v in agreement.items()},  # the trainer's own choice vs the engine's
               "groups/mixed_frac": float(np.mean([len(v) > 1 for v in by_group.values()]))}
    metrics.update({f"verl/{k}": v for k, v in loss_metrics.items() if isinstance(v, float)})
    metrics.update({f"verl/{k}": v for k, v in kl.items() if "/" in k})  # verl's off-policy metrics, float64
    return metrics


def sample_table(scored: Scored, lp: torch.Tensor, old_lp: torch.Tensor, mask: torch.Tensor, n: int = 8) -> list:
    """The first responses of the step (the first groups, whole) with their per-token IS ratio pi / pi_rollout: the
    rows of the W&B rollouts table."""
    ratio = torch.exp(lp.detach().double() - old_lp.double())  # verl's token IS ratio, per response for the table
    rows = []
    for i in range(min(n, len(scored.rollouts))):
        r = ratio[i][mask[i].bool()]
        rows.append({"prompt": scored.prompts[i], "response": scored.texts[i], "reward": scored.rewards[i],
                     "is_ratio_mean": float(r.mean()), "is_ratio_max": float(r.max()), "tokens": int(r.numel())})
    return rows


def grpo_step(s: Session, step: int) -> dict:
    t0 = time.perf_counter()
    idx, groups = generate(s, step)
    t_gen = time.perf_counter()
    scored = score(s, idx, groups)
    t_score = time.perf_counter()
    batch = pack_rollouts(scored.rollouts)
    old_lp, mask = batch.to_matrix(batch.rollout_logprobs)
    adv = advantages(s, scored, mask)
    info = batch_info(s, mask)
    lp, agreement, finite, passes = forward_backward(s, batch, old_lp, mask, adv, info)
    with torch.no_grad():  # the step's loss and verl's metrics as logged: the whole batch's (the parts' sum)
        loss, loss_metrics = loss_of(s, lp, old_lp, adv, mask, info)
    metrics = step_metrics(s, scored, loss, loss_metrics, train_rollout_kl(lp, old_lp, mask), agreement)
    metrics["train/micro_batches"] = passes  # forward/backward passes on each rank (the same on every rank)
    metrics["samples"] = sample_table(scored, lp, old_lp, mask)  # popped by run(): the W&B table at evals
    grad_norm = update(s) if finite else None
    t_train = time.perf_counter()
    if grad_norm is None:  # no update, no sync: the engine keeps the last good adapter
        return {**metrics, "train/skipped_nonfinite": 1.0, "time/step_s": t_train - t0}
    sync = s.sync_adapter()
    t_sync = time.perf_counter()
    return {**metrics, "train/grad_norm": grad_norm, "train/skipped_nonfinite": 0.0, "sync/ms": sync["sync_ms"],
            "sync/verify_ms": sync["verify_ms"], "sync/bytes": sync["bytes"], "sync/checksum": sync["checksum"],
            "sync/rank_checksums": sync["rank_checksums"], "sync/rank_tp_ranks": sync["rank_tp_ranks"],
            "time/generate_s": t_gen - t0,
            "time/score_s": t_score - t_gen, "time/train_s": t_train - t_score, "time/sync_s": t_sync - t_train,
            "time/step_s": t_sync - t0}


def run(s: Session) -> dict:
    """The whole run: resume, sync, check, eval, the steps (checkpoints, non-finite guard), eval, final adapter."""
    c = s.cfg
    (s.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(c, resolve=True))
    logger = MetricsLogger(s.run_dir, c, OmegaConf.to_container(c, resolve=True, enum_to_str=True),
                           enabled=s.rank == 0)
    start = s.resume()
    if s.rank == 0 and c.trainer.resume:
        drop_rows_after(s.run_dir / "metrics.jsonl", start)
    s.sync_adapter()
    summary = {"run_dir": str(s.run_dir), "seed": c.trainer.seed, "model": s.model_path, "warmup": s.warmup_stats,
               "data": s.data_stats, "resumed_from_step": start}
    if c.trainer.check_at_start and start == 0:
        summary["check_step0"] = check = check_session(s)
        s.log("check: " + json.dumps({k: check[k] for k in ("passed", "failures", "weights_exact", "replayed")} |
                                     {"with_replay": check["logprobs"]["with_replay"]}))
        if not check["passed"]:
            raise RuntimeError(f"rl.check failed at step 0: {json.dumps(check)}")
    summary["engine"] = s.layout()
    # replica 0's engine evaluates (all its ranks: a tensor-parallel engine generates together); rank 0 reports
    summary["eval_before"] = s.evaluate() if s.replica == 0 else {}
    s.log(f"eval before: {summary['eval_before']}")
    logger.log_eval(start, summary["eval_before"])
    nan_streak, samples, evaluated = 0, None, None
    freeze_heap()
    for step in range(start + 1, c.trainer.total_training_steps + 1):
        metrics = {**grpo_step(s, step), "engine/restarts": s.engine_restarts}
        samples = metrics.pop("samples", None) or samples
        nan_streak = nan_streak + 1 if metrics.get("train/skipped_nonfinite") else 0
        evaluated = None
        if c.trainer.test_freq and step % c.trainer.test_freq == 0 and s.replica == 0:  # a TP engine: all its ranks
            evaluated = s.evaluate()
            metrics.update({f"eval/{k}": v for k, v in evaluated.items()})
        logger.log(step, metrics)
        if evaluated is not None:
            logger.log_eval(step, evaluated, samples)
        if nan_streak >= c.trainer.max_nan_steps:
            s.save(step, {"stopped": "non-finite loss"})
            raise RuntimeError(f"{nan_streak} non-finite steps in a row (step {step}); checkpoint saved")
        if step % c.trainer.save_freq == 0 or step == c.trainer.total_training_steps:
            s.save(step, {})
    if evaluated is None:  # the last step was not evaluated already (test_freq does not divide it): same adapter
        summary["eval_after"] = s.evaluate() if s.replica == 0 else {}
        logger.log_eval(c.trainer.total_training_steps, summary["eval_after"], samples)  # and the final plots
    else:
        summary["eval_after"] = evaluated
    s.log(f"eval after: {summary['eval_after']}")
    rows = logger.rows
    summary["steps"] = c.trainer.total_training_steps
    summary["nonfinite_steps"] = int(sum(r.get("train/skipped_nonfinite", 0) or 0 for r in rows))
    if rows:
        summary["reward_first"], summary["reward_last"] = rows[0]["reward/mean"], rows[-1]["reward/mean"]
    final = full_adapter_state_dict(s.model, dtype=s.model.dtype)
    summary["final_adapter"] = str(s.run_dir / "final_adapter")
    summary["world_size"] = s.world
    if s.rank == 0:
        write_adapter(final, s.lora_cfg, s.run_dir / "final_adapter")
        logger.log_artifact(s.run_dir / "final_adapter")
        summary["plots"] = sorted(str(p) for p in (s.run_dir / "plots").glob("*.png"))
        (s.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    logger.close()
    return summary


def drop_rows_after(path, step: int) -> None:
    """A run resumed from `step` logs the later steps again: drop their rows (and a line cut by a kill)."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= step:
                keep.append(line)
        except (ValueError, KeyError):
            continue
    path.write_text("".join(f"{line}\n" for line in keep))


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def main(cfg) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # one console line per step, not vLLM's INFO stream
    if cfg.trainer.dry_run:  # checks and the plan only: no model, no engine
        print(json.dumps(plan(cfg), indent=2))
        return
    with Session(cfg) as session:
        summary = run(session)
    print(json.dumps({k: summary[k] for k in ("eval_before", "eval_after", "run_dir")}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
