"""Advantages, the policy loss and the train/rollout metrics, through verl's registries and config objects.

- advantages: `core_algos.get_adv_estimator_fn(algorithm.adv_estimator)` with verl's `AlgoConfig`, called the way
  verl's `ray_trainer.compute_advantage` calls it (outcome reward on the last response token).
- loss: the rollout logprobs are the old logprobs (verl's bypass mode: `rollout_corr_helper.apply_bypass_mode` sets
  `policy_loss.loss_mode=bypass_mode`), so the loss is `get_policy_loss_fn("bypass_mode")` with verl's `ActorConfig`
  (clip ratios, `loss_agg_mode`, `loss_scale_factor`, `global_batch_info`) and `RolloutCorrectionConfig`. Default
  (`loss_type=reinforce`, token TIS, cap 2, token-mean): `-A * log pi * stopgrad(min(pi / pi_rollout, 2))`.
  verl 0.9.1 does not switch the loss for bypass mode by itself (verl#4912): we pass the loss mode explicitly.
- metrics: verl's off-policy metrics (`compute_rollout_corr_metrics_from_logprobs`) and the IS metrics the loss
  returns (`rollout_corr/rollout_is_*`).
"""

import inspect

import numpy as np
import torch
from verl.trainer.config.algorithm import AlgoConfig, RolloutCorrectionConfig
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import (SUPPORTED_ROLLOUT_RS_OPTIONS,
                                                  compute_rollout_corr_metrics_from_logprobs)
from verl.workers.config.actor import ActorConfig, PolicyLossConfig

BYPASS_LOSS_MODE = "bypass_mode"


def check_algorithm_config(algo_cfg) -> None:
    """Values verl would reject mid-run, checked before any heavy work with verl's own code and lists."""
    try:
        core_algos.agg_loss(torch.zeros(1, 1), torch.ones(1, 1), algo_cfg.loss_agg_mode)
    except ValueError:
        raise ValueError(f"algorithm.loss_agg_mode={algo_cfg.loss_agg_mode!r}: verl's agg_loss takes token-mean, "
                         "token-sum, seq-mean-token-sum, seq-mean-token-sum-norm or seq-mean-token-mean") from None
    rs = algo_cfg.rollout_correction.rollout_rs
    unknown = [o.strip() for o in (rs or "").split(",") if o.strip() not in SUPPORTED_ROLLOUT_RS_OPTIONS]
    if rs is not None and unknown:
        raise ValueError(f"algorithm.rollout_correction.rollout_rs={rs!r}: {unknown} not among verl's options "
                         f"{sorted(SUPPORTED_ROLLOUT_RS_OPTIONS)}")
    core_algos.get_adv_estimator_fn(str(algo_cfg.adv_estimator))  # registered in this verl


def _value(x):
    return x.value if hasattr(x, "value") else x  # our StrEnums -> verl's plain strings


def verl_algo_config(algo_cfg) -> AlgoConfig:
    return AlgoConfig(adv_estimator=_value(algo_cfg.adv_estimator), gamma=algo_cfg.gamma, lam=algo_cfg.lam,
                      norm_adv_by_std_in_grpo=algo_cfg.norm_adv_by_std_in_grpo,
                      rollout_correction=rollout_correction_config(algo_cfg))


def rollout_correction_config(algo_cfg) -> RolloutCorrectionConfig:
    rc = algo_cfg.rollout_correction
    return RolloutCorrectionConfig(rollout_is=_value(rc.rollout_is), rollout_is_threshold=rc.rollout_is_threshold,
                                   rollout_is_batch_normalize=rc.rollout_is_batch_normalize,
                                   rollout_rs=rc.rollout_rs, rollout_rs_threshold=rc.rollout_rs_threshold,
                                   bypass_mode=rc.bypass_mode, loss_type=_value(rc.loss_type))


def compute_advantages(rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: np.ndarray,
                       algo_cfg) -> torch.Tensor:
    """[B, L] advantages from outcome rewards [B] by the configured verl estimator (groups = prompts)."""
    token_rewards = torch.zeros_like(response_mask, dtype=torch.float32)
    last = response_mask.long().cumsum(-1).argmax(-1)  # verl's reward managers put the score on the last token
    token_rewards[torch.arange(len(rewards)), last] = rewards.float()
    fn = core_algos.get_adv_estimator_fn(_value(algo_cfg.adv_estimator))
    kwargs = {"token_level_rewards": token_rewards, "response_mask": response_mask.float(), "index": group_ids,
              "config": verl_algo_config(algo_cfg)}
    if "norm_adv_by_std_in_grpo" in inspect.signature(fn).parameters:  # as verl's compute_advantage passes it
        kwargs["norm_adv_by_std_in_grpo"] = algo_cfg.norm_adv_by_std_in_grpo
    adv, _ = fn(**kwargs)
    return adv


def global_batch_info(response_mask: torch.Tensor, world: int, all_reduce=None) -> dict:
    """verl's `ActorConfig.global_batch_info` as its FSDP engine fills it: the data-parallel size and the tokens and
    (non-empty) responses of the whole batch over every rank, so `agg_loss` gives the global mean on each rank."""
    counts = torch.tensor([float(response_mask.sum()), float((response_mask.sum(-1) > 0).sum())], dtype=torch.float64)
    if world > 1:
        all_reduce(counts)
    return {"dp_size": world, "batch_num_tokens": int(counts[0]), "global_batch_size": int(counts[1])}


def actor_config(algo_cfg, actor_cfg, batch_info: dict, rollout_n: int = 2) -> ActorConfig:
    """verl's ActorConfig for the policy loss: our keys are verl's (actor.clip_ratio*, loss_scale_factor)."""
    return ActorConfig(strategy="fsdp2", rollout_n=rollout_n, ppo_micro_batch_size_per_gpu=1,
                       clip_ratio=actor_cfg.clip_ratio, clip_ratio_low=actor_cfg.clip_ratio_low,
                       clip_ratio_high=actor_cfg.clip_ratio_high, clip_ratio_c=actor_cfg.clip_ratio_c,
                       loss_agg_mode=algo_cfg.loss_agg_mode, loss_scale_factor=actor_cfg.loss_scale_factor,
                       policy_loss=PolicyLossConfig(loss_mode=BYPASS_LOSS_MODE,
                                                    rollout_correction=rollout_correction_config(algo_cfg)),
                       global_batch_info={**batch_info, "loss_scale_factor": actor_cfg.loss_scale_factor})


def policy_loss(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, algo_cfg, actor_cfg, batch_info: dict | None = None
                ) -> tuple[torch.Tensor, dict]:
    """verl's bypass-mode loss on [B, L] tensors; returns (loss, verl's metrics). `batch_info`: global_batch_info
    (default: this batch alone, one rank)."""
    mask = response_mask.float()
    config = actor_config(algo_cfg, actor_cfg, batch_info or global_batch_info(mask, 1))
    loss, metrics = core_algos.get_policy_loss_fn(BYPASS_LOSS_MODE)(
        old_log_prob=rollout_log_prob, log_prob=log_prob, advantages=advantages, response_mask=mask,
        loss_agg_mode=config.loss_agg_mode, config=config)
    return loss, {k: float(v) if not isinstance(v, (list, dict)) else v for k, v in metrics.items()}


def train_rollout_kl(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> dict:
    """verl's off-policy metrics (`rollout_corr/kl`, `k3_kl`, ppl, chi2) over response tokens, in float64 (the
    trainer and the engine agree to KL ~1e-12, below float32's resolution of k3); `kl_k1` / `kl_k3` are verl's kl /
    k3_kl under our keys. Ours: |delta logprob| per token (verl reports only sequence-level log-ppl differences)."""
    m = mask.double()
    verl_m = compute_rollout_corr_metrics_from_logprobs(log_prob.double(), rollout_log_prob.double(), m)
    delta = (log_prob.double() - rollout_log_prob.double())[mask.bool()].abs()
    return {"kl_k1": verl_m["rollout_corr/kl"], "kl_k3": verl_m["rollout_corr/k3_kl"],
            "logprob_abs_diff_mean": float(delta.mean()), "logprob_abs_diff_max": float(delta.max()), **verl_m}
