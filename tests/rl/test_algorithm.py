"""rl.algorithm goes through verl's registries and config objects: the default loss is the token-TIS REINFORCE loss
(checked against the formula), every configured estimator dispatches to verl's, loss_agg_mode / clip ratios / the IS
cap come from the config, and ranks' losses with global_batch_info add up to the one-process loss."""

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from verl.trainer.ppo import core_algos

import rl.algorithm as algo
from rl.config import AdvEstimator, register
from tests.rl.test_train import ROOT

register()


def cfg(*overrides):
    with initialize_config_dir(str(ROOT / "configs"), version_base=None):
        return compose(config_name="config", overrides=list(overrides))


def batch(seed=0, b=6, length=7):
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, length, generator=g) * 2
    rollout = lp + 0.6 * torch.randn(b, length, generator=g)
    mask = torch.ones(b, length)
    for i in range(b):
        mask[i, 2 + i % (length - 2):] = 0
    adv = torch.randn(b, 1, generator=g).expand(b, length) * mask
    return lp, rollout, adv, mask


def test_default_loss_is_token_mean_tis_reinforce_with_cap_2():
    c = cfg()
    lp, rollout, adv, mask = batch()
    lp.requires_grad_(True)
    loss, metrics = algo.policy_loss(lp, rollout, adv, mask, c.algorithm, c.actor)
    w = torch.exp(lp.detach() - rollout).clamp(max=2.0)
    expected = (-adv * lp * w * mask).sum() / mask.sum()
    assert torch.equal(loss, expected) or float(loss) == pytest.approx(float(expected), rel=1e-6)
    raw = torch.exp(lp.detach() - rollout)[mask.bool()]
    assert metrics["rollout_corr/rollout_is_ratio_fraction_high"] == pytest.approx(float((raw > 2).float().mean()))
    assert metrics["rollout_corr/rollout_is_max"] <= 2.0


def test_is_cap_and_clip_ratios_and_agg_mode_come_from_the_config():
    lp, rollout, adv, mask = batch(1)
    base = cfg()
    loss = algo.policy_loss(lp, rollout, adv, mask, base.algorithm, base.actor)[0]
    capped = cfg("algorithm.rollout_correction.rollout_is_threshold=1.5")
    assert algo.policy_loss(lp, rollout, adv, mask, capped.algorithm, capped.actor)[1][
        "rollout_corr/rollout_is_max"] <= 1.5
    summed = cfg("algorithm.loss_agg_mode=token-sum")
    assert float(algo.policy_loss(lp, rollout, adv, mask, summed.algorithm, summed.actor)[0]) == pytest.approx(
        float(loss) * float(mask.sum()), rel=1e-5)
    ppo = [cfg("algorithm.rollout_correction.loss_type=ppo_clip", f"actor.clip_ratio_low={r}",
               f"actor.clip_ratio_high={r}") for r in (0.2, 0.05)]
    losses = [float(algo.policy_loss(lp, rollout, adv, mask, c.algorithm, c.actor)[0]) for c in ppo]
    assert losses[0] != losses[1]  # the clip ratios reach verl's ppo_clip loss


@pytest.mark.parametrize("mode", ["token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_ranks_with_global_batch_info_add_up_to_the_one_process_loss(mode):
    c = cfg(f"algorithm.loss_agg_mode={mode}")
    lp, rollout, adv, mask = batch(2)
    whole = algo.policy_loss(lp, rollout, adv, mask, c.algorithm, c.actor)[0]
    shards = [slice(0, 2), slice(2, 6)]  # unequal shares, unequal token counts
    totals = {"dp_size": 2, "batch_num_tokens": int(mask.sum()), "global_batch_size": len(mask)}
    sent = []
    info = algo.global_batch_info(mask[shards[0]], 2, lambda t: (sent.append(t.clone()),
                                                                 t.copy_(torch.tensor([mask.sum(), len(mask)]))))
    assert info == totals and sent[0].tolist() == [float(mask[shards[0]].sum()), 2.0]
    per_rank = [algo.policy_loss(lp[s], rollout[s], adv[s], mask[s], c.algorithm, c.actor, totals)[0] for s in shards]
    assert float(sum(per_rank) / 2) == pytest.approx(float(whole), rel=1e-5)  # FSDP averages over ranks


@pytest.mark.parametrize("estimator", list(AdvEstimator))
def test_every_configured_estimator_is_verls(estimator):
    c = cfg(f"algorithm.adv_estimator={estimator.value}")
    _, _, _, mask = batch(3, b=4)
    rewards, groups = torch.tensor([1.0, 0.0, 1.0, 1.0]), np.array([0, 0, 1, 1])
    adv = algo.compute_advantages(rewards, mask, groups, c.algorithm)
    token_rewards = torch.zeros_like(mask)
    token_rewards[torch.arange(4), mask.long().cumsum(-1).argmax(-1)] = rewards
    fn = core_algos.get_adv_estimator_fn(estimator.value)
    expected, _ = fn(token_level_rewards=token_rewards, response_mask=mask, index=groups,
                     config=algo.verl_algo_config(c.algorithm))
    assert torch.allclose(adv, expected) and adv.shape == mask.shape
    assert (adv[mask == 0] == 0).all()


def test_grpo_default_matches_the_group_normalised_reward():
    c = cfg()
    mask = torch.ones(4, 3)
    adv = algo.compute_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), mask, np.array([0, 0, 1, 1]), c.algorithm)
    assert adv[:, 0].tolist() == pytest.approx([0.7071, -0.7071, 0.0, 0.0], abs=1e-4)


def test_train_rollout_kl_is_verls_in_float64():
    lp, rollout, _, mask = batch(4)
    kl = algo.train_rollout_kl(lp, rollout, mask)
    m = mask.bool()
    d = (lp - rollout).double()[m]
    assert kl["kl_k1"] == pytest.approx(float(-d.mean()))
    assert kl["kl_k3"] == pytest.approx(float((d.exp() - 1 - d).mean()))
    assert kl["logprob_abs_diff_max"] == pytest.approx(float(d.abs().max()))
    assert {"rollout_corr/chi2_token", "rollout_corr/training_ppl"} <= set(kl)
    tiny = algo.train_rollout_kl(lp, lp + 1e-6, mask)["kl_k3"]  # float32 would give noise around 1e-8
    assert tiny == pytest.approx(0.5e-12, rel=1e-3)
