"""Run setup: what one run holds (data, the base checkpoint, the trainer model and its optimizer, the colocated
engine) and the operations on it that more than one entry point needs (the adapter, its sync to the engine, eval,
checkpoints). `rl.train`, `rl.check` and the tests build a `Session`; nothing here runs a training step.
"""

import os
import random
import sys
from pathlib import Path

import numpy as np
import torch
from omegaconf import OmegaConf
from transformers import AutoTokenizer

from rl import checkpointing
from rl.config import validate
from rl.data import encode_prompts, load_splits
from rl.eval import evaluate
from rl.heap import freeze_heap
from rl.model import M3ForTraining, TrainerModelConfig
from rl.model.fsdp import default_mesh, full_adapter_state_dict, init_distributed, shard_layer, shard_model
from rl.model.lora import LoRAConfig, lora_parameters, peft_config
from rl.prompts import DataCursor, TrainPrompts
from rl.warmup import build_builtin_model
from rollout.adapter_sync import adapter_checksum


class Session:
    """Everything one run holds. A context manager: leaving it shuts the engine down."""

    def __init__(self, cfg):
        validate(cfg)  # before any model or engine starts
        self.cfg = cfg
        self.dist = init_distributed()  # torchrun: gloo on CPU, nccl on GPUs; world size 1: nothing
        self.rank, self.world = self.dist.rank, self.dist.world_size
        # verl's hybrid engine: consecutive groups of `tp` ranks share one engine (vLLM's TP groups), replica r of
        # world / tp serves its share of each step's prompts and its ranks train on parts of it
        self.tp = cfg.rollout.tensor_model_parallel_size
        self.replica, self.replicas, self.tp_rank = self.rank // self.tp, self.world // self.tp, self.rank % self.tp
        torch.manual_seed(cfg.trainer.seed)
        random.seed(cfg.trainer.seed)
        np.random.seed(cfg.trainer.seed)
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.train_rows, self.eval_rows, self.data_stats = load_splits(cfg.data,
                                                                       Path(cfg.trainer.cache_dir) / "datasets")
        self.model_path, self.warmup_stats = self._base_checkpoint()
        # The warm-up above ran on every core; the RL phase runs the trainer and the in-process engine on
        # M3RL_TORCH_THREADS (default 1). Measured on the 2-core CPU: 2 threads make the engine's adapter generate
        # 1.3x faster when nothing else runs, but 3-20x slower when another process takes a core (OpenMP threads
        # spin on the busy core), so the default is the robust one. Set before the engine starts: vLLM's CPU
        # worker then blocks torch.set_num_threads.
        torch.set_num_threads(int(os.environ.get("M3RL_TORCH_THREADS", "1")))
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        max_prompt = cfg.data.max_prompt_length
        # Training prompts are tokenized as the cursor draws them (rl.prompts); first_fit fails a max_prompt_length
        # no prompt fits here, before any model or engine. The eval split (data.val_size rows) is tokenized whole.
        self.train_prompts = TrainPrompts(self.train_rows, self.tokenizer, max_prompt, log=self.log)
        self.train_prompts.first_fit()
        self.eval_rows, self.eval_prompts, _ = encode_prompts(self.eval_rows, self.tokenizer, max_prompt)
        self.data_stats["dropped_overlong"] = self.train_prompts.n_too_long  # so far; generate() keeps it current
        if not self.eval_rows:
            raise ValueError(f"data.max_prompt_length={max_prompt}: no eval prompt fits (all longer)")
        self.eos = [self.tokenizer.convert_tokens_to_ids("<|im_end|>"), self.tokenizer.eos_token_id]
        self.lora_cfg = LoRAConfig(**OmegaConf.to_container(cfg.model.lora))
        self.model = self._trainer_model()
        self.params = lora_parameters(self.model)
        o = cfg.actor.optim
        self.optimizer = torch.optim.AdamW(self.params, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay)
        # Adam's first updates are ~lr * sign(grad) whatever the gradient's noise: ramp the rate up
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda i: min(1.0, (i + 1) / o.lr_warmup_steps) if o.lr_warmup_steps > 0 else 1.0)
        self.cursor = DataCursor(len(self.train_rows), seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        self.engine = self._engine()
        self.engine_restarts = 0  # over the run; rollout.max_restarts bounds it
        self.adapter_synced = False

    def _base_checkpoint(self) -> tuple[str, dict]:
        path = self.cfg.model.path
        if path != "builtin":
            if not (Path(path) / "config.json").is_file():
                raise FileNotFoundError(f"model.path: no checkpoint (config.json) at {path}")
            return str(path), {}
        stats = {}
        for turn in range(min(self.world, 2)):  # rank 0 builds; the others then reuse its cache
            if (self.rank == 0) == (turn == 0):
                path, stats = build_builtin_model(self.cfg, self.train_rows, self.eval_rows, log=self.log)
            self.barrier()
        return str(path), stats

    def _trainer_model(self) -> M3ForTraining:
        m = self.cfg.model
        on_layer = None
        if self.world > 1:  # shard each layer as soon as it is built: a full-size base never exists unsharded
            mesh, shard_base = default_mesh(), self.cfg.actor.fsdp_config.shard_base
            on_layer = lambda layer: shard_layer(layer, mesh, shard_base=shard_base)  # noqa: E731
        model = M3ForTraining(TrainerModelConfig(
            path=self.model_path, dtype=m.dtype, base=m.base, profile=m.profile, kv_cache_dtype=m.kv_cache_dtype,
            indexer_kv_dtype=m.indexer_kv_dtype, attention_impl=m.attention_impl, moe_impl=m.moe_impl,
            activation_checkpointing=m.activation_checkpointing, moe_chunk_tokens=m.moe_chunk_tokens,
            lora=self.lora_cfg), on_layer=on_layer)
        if self.world > 1:
            shard_model(model, mesh=mesh, shard_base=shard_base)
        return model

    def _engine(self):
        from rollout.engine import EngineConfig, RolloutEngine  # imports vLLM, after main() set its logging level

        c = self.cfg
        engine = RolloutEngine(EngineConfig(
            model=self.model_path, dtype=c.model.dtype, max_model_len=c.rollout.max_model_len,
            max_num_seqs=c.rollout.max_num_seqs, kv_cache_memory_bytes=c.rollout.kv_cache_memory_bytes,
            gpu_memory_utilization=c.rollout.gpu_memory_utilization, max_lora_rank=c.model.lora.rank,
            kv_cache_dtype=c.model.kv_cache_dtype, indexer_kv_dtype=c.model.indexer_kv_dtype,
            capture_routing=True, capture_blocks=True,  # replay or not, agreement is measured
            enable_prefix_caching=c.rollout.enable_prefix_caching, enforce_eager=c.rollout.enforce_eager,
            # under torchrun vLLM's worker runs in this process on the trainer's process group (a collective
            # build: every rank constructs its engine here, together)
            distributed_executor_backend="external_launcher" if self.world > 1 else None,
            tensor_parallel_size=self.tp, enable_expert_parallel=c.rollout.enable_expert_parallel,
            free_cache_engine=c.rollout.free_cache_engine,
            seed=c.trainer.seed, extra={k: v for k, v in OmegaConf.to_container(c.rollout.engine_kwargs,
                                                                                 resolve=True).items()
                                        if v is not None}))  # null: vLLM's default (a recipe unsets a parent's)
        if engine.free_cache_unsupported:
            self.log(f"rollout.free_cache_engine: {engine.free_cache_unsupported}; the engine keeps its memory "
                     "while the trainer runs")
        return engine

    def layout(self) -> dict:
        return {"world_size": self.world, "tensor_model_parallel_size": self.tp, "engine_replicas": self.replicas,
                "engine_sleeps_while_training": self.engine.sleep_enabled}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.engine.close()

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(f"[m3rl] {msg}", file=sys.stderr, flush=True)  # stdout: the step lines and JSON results

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def all_ranks(self, ok: bool) -> bool:
        """True when `ok` holds on every rank: decisions that gate collectives (backward, sync) are taken together."""
        if self.world == 1:
            return bool(ok)
        flag = torch.tensor([1.0 if ok else 0.0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
        return bool(flag.item())

    def all_gather(self, obj) -> list:
        if self.world == 1:
            return [obj]
        out = [None] * self.world
        torch.distributed.all_gather_object(out, obj)
        return out

    def check_engine_group_agrees(self, digest: str, what: str) -> None:
        """The ranks of one tensor-parallel engine each run vLLM's scheduler and sampler; they must have produced the
        same `what` (vLLM's external_launcher relies on it, nothing in vLLM checks it)."""
        if self.tp == 1:
            return
        got = self.all_gather(digest)
        split = [r for r in range(self.replicas) if len(set(got[r * self.tp:(r + 1) * self.tp])) > 1]
        if split:
            raise RuntimeError(f"engine replica(s) {split}: the tensor-parallel ranks of one engine got different "
                               f"{what}; stopping")

    # -- the adapter, the engine, the run folder ------------------------------------------------------------------
    def adapter(self) -> tuple[dict, dict]:
        """The full adapter (peft names, the model dtype) on every rank, and its peft config."""
        return full_adapter_state_dict(self.model, dtype=self.model.dtype, rank0_only=False), \
            peft_config(self.lora_cfg)

    def sync_adapter(self) -> dict:
        """Send only the adapter to the engine, in memory; every rank must have installed the same bytes."""
        tensors, peft_cfg = self.adapter()
        info = self.engine_call("adapter sync", lambda engine: engine.load_adapter(tensors, peft_cfg))
        self.adapter_synced = True
        if info["checksum"] != adapter_checksum(tensors):
            raise RuntimeError("adapter sync: the engine's checksum differs from the trainer's; stopping")
        ranks = self.all_gather((info["checksum"], info["tp_ranks"]))
        if len({c for c, _ in ranks}) != 1:
            raise RuntimeError(f"adapter sync: ranks installed different adapters {ranks}; stopping")
        info["rank_checksums"] = [c for c, _ in ranks]
        info["rank_tp_ranks"] = [t for _, t in ranks]  # the engine shard each rank installed and verified
        return info

    def engine_call(self, stage: str, fn):
        """`fn(engine)`, decided by every rank together. An engine that fails (a dead engine-core or worker process,
        an error inside vLLM) fails the step on every rank with one error naming the engine and the cause, before
        anything of the step is saved; with rollout.max_restarts=N (over the run) the failed engines are rebuilt,
        the adapter the trainer holds reinstalled (load_adapter checks installed == held) and `fn` run again."""
        out, done, rebuild, tensors = None, False, False, None
        while True:
            error = None
            try:
                if rebuild:
                    self._rebuild_engine(tensors)
                    rebuild = False
                if not done:
                    out, done = fn(self.engine), True
            except Exception as e:  # noqa: BLE001  (decided with the other ranks below, then raised)
                error = e
            report = None if error is None else f"{self.engine.describe()}: {type(error).__name__}: {error}"
            failed = {r: msg for r, msg in enumerate(self.all_gather(report)) if msg}
            if not failed:
                return out
            limit = self.cfg.rollout.max_restarts
            if self.engine_restarts >= limit:  # every rank stops, none waits in a collective for the one that failed
                raise RuntimeError(f"{stage} failed on rank(s) {sorted(failed)}: {failed} (engine restarts used: "
                                   f"{self.engine_restarts} of rollout.max_restarts={limit})") from error
            self.engine_restarts += 1
            self.log(f"WARNING: {stage} failed on rank(s) {sorted(failed)}: {failed}; rebuilding the engine "
                     f"(restart {self.engine_restarts} of rollout.max_restarts={limit})")
            tensors = self.adapter() if self.adapter_synced else None  # collective: on every rank
            rebuild = error is not None or self.tp > 1  # a TP engine is rebuilt by all its ranks together

    def _rebuild_engine(self, adapter) -> None:
        self.engine.close()
        self.engine = self._engine()
        if adapter is not None:
            self.engine.load_adapter(*adapter)
        freeze_heap()

    def evaluate(self) -> dict:
        """On the eval split, through the colocated engine (rl.eval): pass@1 of the policy being trained (k samples
        per problem at the rollout temperature; its unbiased estimate is the mean accuracy, avg@k), pass@k, and the
        greedy decode's accuracy (`greedy_pass@1`, a different policy: the argmax)."""
        c = self.cfg
        k = c.trainer.eval_k
        sampled = evaluate(self.engine, self.eval_rows, k=k, temperature=c.rollout.temperature,
                           max_tokens=c.data.max_response_length, seed=c.trainer.seed, return_details=False)
        greedy = evaluate(self.engine, self.eval_rows, k=1, temperature=0.0, max_tokens=c.data.max_response_length,
                          seed=c.trainer.seed, return_details=False)
        return {"pass@1": sampled["avg@k"], "pass@k": sampled["pass@k"], "k": k, "greedy_pass@1": greedy["pass@1"],
                **{f"pass@{j}_unbiased": v for j, v in sampled["pass@j_unbiased"].items() if j not in ("1", str(k))},
                f"maj@{k}": sampled["val_core"].get(f"acc/maj@{k}/mean", float("nan"))}  # verl's majority vote

    def save(self, step: int, extra: dict) -> None:
        adapter = full_adapter_state_dict(self.model, dtype=torch.float32)  # collective; rank 0 gets the tensors
        checkpointing.save(self.run_dir, step, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                           cursor=self.cursor, adapter_fp32=adapter, lora_cfg=self.lora_cfg, extra=extra,
                           rank=self.rank, world=self.world, barrier=self.barrier,
                           keep=self.cfg.trainer.max_actor_ckpt_to_keep)

    def resume(self) -> int:
        """The step to continue after: that of the newest valid checkpoint in the run folder (0 when none). Newer
        ones that are incomplete or corrupt are named in a warning and passed over."""
        if not self.cfg.trainer.resume:
            return 0
        path, skipped = checkpointing.newest_valid(self.run_dir)
        for problem in skipped:
            self.log(f"WARNING: skipping checkpoint: {problem}")
        if path is None:
            return 0
        start = checkpointing.load(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                   cursor=self.cursor, rank=self.rank, world=self.world)["step"]
        self.log(f"resumed from {path} at step {start}")
        return start

