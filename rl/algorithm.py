"""GRPO advantages and the token-level truncated-IS policy loss, from verl's library.

The rollout logprobs are the old logprobs (verl's bypass mode) and there is one optimizer step per batch, so the
loss is verl's `compute_policy_loss_bypass_mode` with `loss_type=reinforce`: `-A * log pi * w`, with
`w = stopgrad(min(pi / pi_rollout, 2))` per token. verl 0.9.1 does not switch the loss for bypass mode by itself
(verl#4912): we call the bypass-mode loss directly with its rollout_correction config.
"""

import numpy as np
import torch
from omegaconf import OmegaConf
from verl.trainer.ppo import core_algos
from verl.trainer.ppo.rollout_corr_helper import SUPPORTED_ROLLOUT_RS_OPTIONS


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


def grpo_advantages(rewards: torch.Tensor, response_mask: torch.Tensor, group_ids: np.ndarray,
                    norm_by_std: bool = True) -> torch.Tensor:
    """[B, L] advantages (one scalar per response, broadcast over its tokens) from outcome rewards [B]."""
    token_rewards = torch.zeros_like(response_mask, dtype=torch.float32)
    last = response_mask.long().cumsum(-1).argmax(-1)  # verl puts the outcome reward on the last response token
    token_rewards[torch.arange(len(rewards)), last] = rewards.float()
    adv, _ = core_algos.compute_grpo_outcome_advantage(token_rewards, response_mask.float(), group_ids,
                                                       norm_adv_by_std_in_grpo=norm_by_std)
    return adv


def policy_loss(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, advantages: torch.Tensor,
                response_mask: torch.Tensor, algo_cfg) -> tuple[torch.Tensor, dict]:
    """verl's bypass-mode loss (token TIS, REINFORCE form) on [B, L] tensors; returns (loss, verl's metrics)."""
    rc = algo_cfg.rollout_correction
    actor_cfg = OmegaConf.create({
        "policy_loss": {"loss_mode": "bypass_mode", "rollout_correction": {
            "loss_type": rc.loss_type, "rollout_is": rc.rollout_is, "rollout_is_threshold": rc.rollout_is_threshold,
            "rollout_is_batch_normalize": rc.rollout_is_batch_normalize, "rollout_rs": rc.rollout_rs,
            "rollout_rs_threshold": rc.rollout_rs_threshold}},
        "loss_agg_mode": algo_cfg.loss_agg_mode, "clip_ratio": 0.2, "clip_ratio_low": 0.2, "clip_ratio_high": 0.2,
        "clip_ratio_c": 3.0, "global_batch_info": {}})
    loss, metrics = core_algos.compute_policy_loss_bypass_mode(
        old_log_prob=rollout_log_prob, log_prob=log_prob, advantages=advantages, response_mask=response_mask.float(),
        loss_agg_mode=algo_cfg.loss_agg_mode, config=actor_cfg)
    return loss, {k: float(v) if not isinstance(v, (list, dict)) else v for k, v in metrics.items()}


def train_rollout_kl(log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor) -> dict:
    """KL(rollout || train) estimators over response tokens: k1 = mean(log pi_r - log pi), k3 (low-variance)."""
    m = mask.bool()
    lr, lt = rollout_log_prob[m].double(), log_prob[m].double()
    ratio = torch.exp(lt - lr)
    return {"kl_k1": float((lr - lt).mean()), "kl_k3": float((ratio - 1 - (lt - lr)).mean()),
            "logprob_abs_diff_mean": float((lt - lr).abs().mean()), "logprob_abs_diff_max": float((lt - lr).abs().max()),
            "is_ratio_mean": float(ratio.mean()), "is_ratio_max": float(ratio.max()),
            "is_ratio_capped_frac": float((ratio > 2.0).double().mean())}
