"""Typed configs for `python -m rl.train` / `python -m rl.check` (Hydra structured configs: unknown or mistyped
keys fail at composition, before any model or engine starts). Key names follow verl where they overlap:
algorithm.adv_estimator, algorithm.norm_adv_by_std_in_grpo, algorithm.rollout_correction.{rollout_is,
rollout_is_threshold, bypass_mode, loss_type}, actor.ppo_epochs, actor.ppo_mini_batch_size, rollout.n,
data.train_batch_size, model.lora.{rank, alpha, target_modules}, trainer.total_training_steps / save_freq /
test_freq."""

import os
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from rl.model.lora import LoRAConfig
from rl.model.options import AttentionImpl, Base, DType, IndexerKVDType, KVCacheDType, MoEImpl, Profile
from rollout.adapter_sync import SERVED_LORA_RANKS


# The pipeline's choices; the model's are in rl/model/options.py. Enum-typed fields: Hydra rejects any other value
# when the config is composed.
class DataKind(StrEnum):
    verl = "verl"  # verl's parquet layout (prompt, reward_model.ground_truth, data_source)
    dapo_math_17k = "dapo_math_17k"
    aime_2024 = "aime_2024"


class OnBadRow(StrEnum):
    skip = "skip"  # counted in the run summary
    error = "error"  # with the row id


class AdvEstimator(StrEnum):  # verl's registered outcome estimators (core_algos.get_adv_estimator_fn); gae needs a
    # critic, remax greedy baselines, *optimal_token_baseline sum(pi^2) from the actor, gdpo per-dimension rewards
    grpo = "grpo"
    grpo_vectorized = "grpo_vectorized"
    grpo_passk = "grpo_passk"
    rloo = "rloo"
    rloo_vectorized = "rloo_vectorized"
    opo = "opo"
    reinforce_plus_plus = "reinforce_plus_plus"
    reinforce_plus_plus_baseline = "reinforce_plus_plus_baseline"
    gpg = "gpg"


class RolloutIS(StrEnum):
    token = "token"


class LossType(StrEnum):
    reinforce = "reinforce"  # token-level IS: -A * log pi * min(pi/pi_rollout, threshold)
    ppo_clip = "ppo_clip"


class WandbMode(StrEnum):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class ModelCfg:
    path: str = "builtin"  # "builtin": build/reuse the tiny M3, SFT warm-up, quantize (the embedded default)
    dtype: DType = DType.bfloat16
    base: Base = Base.quantized
    profile: Profile = Profile.hopper
    kv_cache_dtype: KVCacheDType = KVCacheDType.auto
    indexer_kv_dtype: IndexerKVDType = IndexerKVDType.bf16
    attention_impl: AttentionImpl = AttentionImpl.auto
    moe_impl: MoEImpl = MoEImpl.auto
    activation_checkpointing: bool = False
    moe_chunk_tokens: int = 0
    lora: LoRAConfig = field(default_factory=LoRAConfig)  # rank 32, alpha 64, every target (rl/model/lora.py)


@dataclass
class WarmupCfg:  # the embedded default only: supervised warm-up of the tiny model before RL
    max_steps: int = 800
    batch_size: int = 64
    lr: float = 3e-3
    eval_every: int = 5  # near the target, so the stop lands near it on every seed (checked every 25 steps, the stop
    # overshot to 0.50-0.67 by seed, and RL's headroom varied with it)
    coarse_eval_every: int = 25  # while the last eval is below a third of the target (before grokking); ~0.5 s each
    # Stop at the first eval at or above this. Measured (results/make_train_cpu.json): from 0.25 (mid-grokking) 40
    # GRPO steps moved pass@1 by < 0.1; from 0.45-0.5 the sampled policy sharpens towards its pass@k (~0.8).
    target_sampled_acc: float = 0.45
    # A 2-layer tiny M3 (layer 0 dense, layer 1 MoE + MSA, 4 experts): the same code paths as the 4-layer test
    # model, half the compute; on the 2-core CPU it "groks" 2-digit addition after ~450-550 SFT steps.
    tiny_overrides: dict[str, Any] = field(default_factory=lambda: {"num_hidden_layers": 2, "num_local_experts": 4})


@dataclass
class DataCfg:
    train_files: str = "builtin"  # "builtin": the 2-digit addition task (scripts/make_data.py), or a parquet path
    val_files: str = "builtin"
    kind: DataKind = DataKind.verl
    train_batch_size: int = 16  # prompts per step
    val_size: int = 200
    max_prompt_length: int = 256
    max_response_length: int = 16
    on_bad_row: OnBadRow = OnBadRow.skip
    shuffle: bool = True
    seed: int = 0


@dataclass
class RolloutCorrectionCfg:
    rollout_is: RolloutIS | None = RolloutIS.token
    rollout_is_threshold: float = 2.0
    bypass_mode: bool = True  # the rollout logprobs are the old logprobs: no recompute pass
    loss_type: LossType = LossType.reinforce
    rollout_rs: str | None = None
    rollout_rs_threshold: float | None = None
    rollout_is_batch_normalize: bool = False


@dataclass
class AlgorithmCfg:
    adv_estimator: AdvEstimator = AdvEstimator.grpo
    norm_adv_by_std_in_grpo: bool = True
    gamma: float = 1.0  # verl's key: reinforce_plus_plus's discount
    lam: float = 1.0  # verl's key (GAE's lambda, which needs a critic: kept for verl's AlgoConfig)
    loss_agg_mode: str = "token-mean"
    rollout_correction: RolloutCorrectionCfg = field(default_factory=RolloutCorrectionCfg)


@dataclass
class OptimCfg:
    lr: float = 1e-3
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    lr_warmup_steps: int = 5  # verl's key: linear warm-up from 0 over this many optimizer steps, then constant


@dataclass
class FSDPCfg:  # under torchrun (world size > 1); see rl/model/fsdp.py
    shard_base: bool = False  # also shard the frozen quantized base (needed when it does not fit one GPU: full M3)


@dataclass
class ActorCfg:
    ppo_epochs: int = 1
    ppo_mini_batch_size: int | None = None  # None = data.train_batch_size: one optimizer step per batch
    # verl's key: sequences per forward/backward on each GPU, gradients accumulated over them into the one step
    # (None: the rank's whole share in one pass; ignored with use_dynamic_bsz). Activation memory follows it:
    # rl.sizing and the dry run use it.
    ppo_micro_batch_size_per_gpu: int | None = None
    # verl's keys: micro-batches by tokens instead (sequences packed in order up to this many tokens per pass)
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    # verl's ActorConfig keys and defaults; the clip ratios act with rollout_correction.loss_type=ppo_clip
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_scale_factor: int | None = None  # seq-mean-token-sum-norm's divisor (None: the padded response length)
    routing_replay: bool = True
    block_replay: bool = True  # the engine's MSA blocks are part of the same forward (always captured)
    optim: OptimCfg = field(default_factory=OptimCfg)
    fsdp_config: FSDPCfg = field(default_factory=FSDPCfg)


@dataclass
class RolloutCfg:
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    max_num_seqs: int = 128
    max_model_len: int = 1024
    kv_cache_memory_bytes: int | None = 64 << 20
    gpu_memory_utilization: float = 0.5
    enforce_eager: bool = True
    enable_prefix_caching: bool = False
    # verl's hybrid engine: each group of this many trainer ranks shares one colocated vLLM engine (external_launcher);
    # world_size / tensor_model_parallel_size engine replicas split a step's prompts
    tensor_model_parallel_size: int = 1
    enable_expert_parallel: bool = False  # vLLM's expert parallelism inside each engine (GPUs)
    free_cache_engine: bool = False  # verl's key: the engine sleeps (level 1) while the trainer runs (GPUs)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # passed to vllm.LLM as they are (GPU flags)
    max_restarts: int = 0  # a failed engine (dead process) is rebuilt and the step retried, this often per run


@dataclass
class CheckCfg:  # rl.check thresholds (also run at step 0 of training)
    max_mean_abs_logprob_diff: float | None = None  # None: by model.dtype (rl/check.py GATES)
    max_kl: float | None = None  # KL(rollout || train), k3 estimator; None: by model.dtype
    min_replayed_agreement: float = 1.0  # rows whose replayed forward used the engine's experts / blocks
    min_agreement: float | None = None  # the trainer's own expert / block choice vs the engine's; None: by dtype
    attribution: bool = False  # also the KL of variants that each remove one source of agreement (rl/attribution.py)
    adapter: str | None = None  # a peft adapter directory to check instead of the fresh one (a final_adapter)
    batch_prompts: int = 4


@dataclass
class TrainerCfg:
    total_training_steps: int = 100
    save_freq: int = 10
    test_freq: int = 0  # 0: eval only before and after
    run_dir: str = "runs/${now:%Y%m%d-%H%M%S}"
    resume: bool = True
    seed: int = 0
    max_nan_steps: int = 3  # this many non-finite losses in a row stop the run (with a checkpoint)
    max_actor_ckpt_to_keep: int | None = None  # verl's key: only the newest this many checkpoints stay (null: all)
    check_at_start: bool = True
    eval_k: int = 4  # samples per eval problem at rollout.temperature (pass@1 = their mean accuracy); greedy too
    cache_dir: str = "cache"
    dry_run: bool = False  # validate config, checkpoint headers and data, print the plan as JSON, exit (rl/plan.py)
    # verl's keys for the job size; null: torchrun's WORLD_SIZE (and the dry run's plan assumes 1 node of it)
    nnodes: int | None = None
    n_gpus_per_node: int | None = None


@dataclass
class LoggerCfg:
    wandb_mode: WandbMode = WandbMode.offline  # online: set WANDB_API_KEY (README)
    project: str = "m3rl"  # verl's trainer.project_name
    entity: str | None = None  # W&B team or user; None: the API key's default
    experiment_name: str | None = None  # verl's trainer.experiment_name; None: the run folder's name
    console: bool = True


@dataclass
class Config:
    model: ModelCfg = field(default_factory=ModelCfg)
    warmup: WarmupCfg = field(default_factory=WarmupCfg)
    data: DataCfg = field(default_factory=DataCfg)
    algorithm: AlgorithmCfg = field(default_factory=AlgorithmCfg)
    actor: ActorCfg = field(default_factory=ActorCfg)
    rollout: RolloutCfg = field(default_factory=RolloutCfg)
    check: CheckCfg = field(default_factory=CheckCfg)
    trainer: TrainerCfg = field(default_factory=TrainerCfg)
    logger: LoggerCfg = field(default_factory=LoggerCfg)


_SEED = (0, 2**32 - 1)  # numpy's seed range
# Bounds of every numeric key (Hydra checks only types): (low, high), None = unbounded, a "(" or ")" marks an open
# end. validate checks them (floats must also be finite); tests/rl/test_config_fuzz.py draws values outside each and
# fails for a numeric field of the schema that is missing here.
BOUNDS = {
    "model.moe_chunk_tokens": (0, None), "model.lora.rank": (1, None), "model.lora.alpha": ("(", 0, None),
    "model.lora.dropout": (0.0, 1.0, ")"),
    "warmup.max_steps": (0, None), "warmup.batch_size": (1, None), "warmup.lr": ("(", 0.0, None),
    "warmup.eval_every": (1, None), "warmup.coarse_eval_every": (1, None), "warmup.target_sampled_acc": (0.0, 1.0),
    "data.train_batch_size": (1, None), "data.val_size": (1, None), "data.max_prompt_length": (1, None),
    "data.max_response_length": (1, None), "data.seed": _SEED,
    "algorithm.gamma": (0.0, 1.0), "algorithm.lam": (0.0, 1.0),
    "algorithm.rollout_correction.rollout_is_threshold": ("(", 1.0, None),
    "algorithm.rollout_correction.rollout_rs_threshold": ("(", 0.0, None),
    "actor.ppo_epochs": (1, 1), "actor.ppo_mini_batch_size": (1, None),
    "actor.ppo_micro_batch_size_per_gpu": (1, None), "actor.ppo_max_token_len_per_gpu": (1, None),
    "actor.optim.lr": ("(", 0.0, None),
    "actor.optim.betas": (0.0, 1.0, ")"), "actor.optim.weight_decay": (0.0, None),
    "actor.optim.grad_clip": ("(", 0.0, None),
    "actor.optim.lr_warmup_steps": (0, None),
    "actor.clip_ratio": ("(", 0.0, None), "actor.clip_ratio_low": ("(", 0.0, None),
    "actor.clip_ratio_high": ("(", 0.0, None), "actor.clip_ratio_c": ("(", 1.0, None),  # verl: dual-clip c > 1
    "actor.loss_scale_factor": (1, None),
    "rollout.n": (2, None), "rollout.temperature": ("(", 0.0, None), "rollout.top_p": ("(", 0.0, 1.0),
    "rollout.max_num_seqs": (1, None), "rollout.max_model_len": (1, None), "rollout.kv_cache_memory_bytes": (1, None),
    "rollout.gpu_memory_utilization": ("(", 0.0, 1.0), "rollout.tensor_model_parallel_size": (1, None),
    "rollout.max_restarts": (0, None),
    "check.max_mean_abs_logprob_diff": (0.0, None), "check.max_kl": (0.0, None),
    "check.min_replayed_agreement": (0.0, 1.0), "check.min_agreement": (0.0, 1.0), "check.batch_prompts": (1, None),
    "trainer.total_training_steps": (1, None), "trainer.save_freq": (1, None), "trainer.test_freq": (0, None),
    "trainer.seed": _SEED, "trainer.max_nan_steps": (1, None), "trainer.max_actor_ckpt_to_keep": (1, None),
    "trainer.eval_k": (1, None), "trainer.nnodes": (1, None), "trainer.n_gpus_per_node": (1, None),
}
NONEMPTY = ("model.path", "data.train_files", "data.val_files", "trainer.run_dir", "trainer.cache_dir",
            "logger.project")  # "" would be the working directory or no file at all


def _check_bounds(cfg) -> None:
    import math

    for key, bound in BOUNDS.items():
        lo_open, hi_open = bound[0] == "(", bound[-1] == ")"
        lo, hi = [b for b in bound if b not in ("(", ")")]
        value = OmegaConf.select(cfg, key)
        for v in (value if OmegaConf.is_list(value) else [value]):
            if v is None:
                continue  # Optional keys only: Hydra rejects null elsewhere
            above = lo is None or (v > lo if lo_open else v >= lo)
            below = hi is None or (v < hi if hi_open else v <= hi)
            if not (above and below and (not isinstance(v, float) or math.isfinite(v))):
                where = f"{'(' if lo_open else '['}{'-inf' if lo is None else lo}, {'inf' if hi is None else hi}"
                raise ValueError(f"{key}={value}: must be in {where}{')' if hi_open else ']'}")
    if len(cfg.actor.optim.betas) != 2:
        raise ValueError(f"actor.optim.betas={cfg.actor.optim.betas}: Adam takes two")
    for key in NONEMPTY:
        if not str(OmegaConf.select(cfg, key)).strip():
            raise ValueError(f"{key}: empty")


def validate(cfg) -> None:
    """Value checks Hydra's types cannot express; one error naming the key. Runs before anything heavy."""
    rc = cfg.algorithm.rollout_correction
    if not rc.bypass_mode:
        raise ValueError("algorithm.rollout_correction.bypass_mode=false: this trainer has no recompute pass; the "
                         "rollout logprobs are the old logprobs (bypass mode)")
    if rc.rollout_is_threshold <= 1.0:
        raise ValueError(f"algorithm.rollout_correction.rollout_is_threshold={rc.rollout_is_threshold}: must be > 1")
    mini = cfg.actor.ppo_mini_batch_size
    if cfg.actor.ppo_epochs != 1 or (mini is not None and mini != cfg.data.train_batch_size):
        raise ValueError("actor.ppo_epochs must be 1 and actor.ppo_mini_batch_size = data.train_batch_size: one "
                         "optimizer step per batch, so the rollout policy is the old policy")
    longest = cfg.data.max_prompt_length + cfg.data.max_response_length
    if cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu < longest:
        raise ValueError(f"actor.ppo_max_token_len_per_gpu={cfg.actor.ppo_max_token_len_per_gpu} < "
                         f"data.max_prompt_length + data.max_response_length = {longest}: a sequence must fit one pass")
    for key in ("data.train_batch_size", "rollout.n", "trainer.total_training_steps", "data.max_response_length"):
        if OmegaConf.select(cfg, key) < 1:
            raise ValueError(f"{key}={OmegaConf.select(cfg, key)}: must be >= 1")
    if cfg.actor.optim.lr_warmup_steps < 0:
        raise ValueError(f"actor.optim.lr_warmup_steps={cfg.actor.optim.lr_warmup_steps}: must be >= 0")
    if cfg.rollout.n < 2:
        raise ValueError("rollout.n must be >= 2: GRPO needs groups to compute advantages")
    for key in ("trainer.save_freq", "trainer.max_nan_steps"):
        if OmegaConf.select(cfg, key) < 1:
            raise ValueError(f"{key}={OmegaConf.select(cfg, key)}: must be >= 1")
    validate_layout(cfg, world_size(cfg))
    need = cfg.data.max_prompt_length + cfg.data.max_response_length
    if cfg.rollout.max_model_len < need:
        raise ValueError(f"rollout.max_model_len={cfg.rollout.max_model_len} < data.max_prompt_length + "
                         f"data.max_response_length = {need}: the engine could not hold a full response")
    _check_bounds(cfg)
    LoRAConfig(**OmegaConf.to_container(cfg.model.lora)).validate()
    from rl.algorithm import check_algorithm_config  # imports verl (seconds): only when a run is validated

    check_algorithm_config(cfg.algorithm)
    if cfg.model.lora.rank not in SERVED_LORA_RANKS:
        raise ValueError(f"model.lora.rank={cfg.model.lora.rank}: vLLM serves {list(SERVED_LORA_RANKS)}")


def world_size(cfg) -> int:
    """Ranks of the job: torchrun's WORLD_SIZE when launched by it (checked against trainer.nnodes x
    trainer.n_gpus_per_node when those are set), else nnodes x n_gpus_per_node (a dry run's plan), else 1."""
    t = cfg.trainer
    declared = (t.nnodes or 1) * (t.n_gpus_per_node or 1) if (t.nnodes or t.n_gpus_per_node) else None
    launched = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else None
    if launched is not None and declared is not None and launched != declared and not t.dry_run:
        raise ValueError(f"trainer.nnodes x trainer.n_gpus_per_node = {declared}, but torchrun started {launched} "
                         "ranks")
    return (declared if t.dry_run and declared else launched) or declared or 1


def validate_layout(cfg, world: int) -> None:
    """The engine layout over `world` trainer ranks (torchrun's WORLD_SIZE): world / tp engine replicas of tp ranks
    each, every rank training on its own part of the step's prompts."""
    tp = cfg.rollout.tensor_model_parallel_size
    if tp < 1:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp}: must be >= 1")
    if world % tp:
        raise ValueError(f"rollout.tensor_model_parallel_size={tp} does not divide the world size {world} "
                         "(torchrun --nproc-per-node): each group of that many trainer ranks shares one engine")
    if cfg.data.train_batch_size < world:
        raise ValueError(f"data.train_batch_size={cfg.data.train_batch_size} < world size {world}: every rank "
                         "trains on at least one prompt per step")


# Hydra's own settings for every m3rl config (configs/config.yaml and the recipes list `m3rl_hydra` after the
# schema): logs go to stderr because stdout carries the step lines, rl.check's JSON and the dry run's plan; the run's
# files go to trainer.run_dir, not ./outputs/DATE.
HYDRA_SETTINGS = {"hydra": {"job_logging": {"handlers": {"console": {"stream": "ext://sys.stderr"}}},
                            "run": {"dir": "${trainer.run_dir}"}, "output_subdir": "hydra", "job": {"chdir": False}}}


def register() -> None:
    ConfigStore.instance().store(name="m3rl_schema", node=Config)
    ConfigStore.instance().store(name="m3rl_hydra", node=HYDRA_SETTINGS)
