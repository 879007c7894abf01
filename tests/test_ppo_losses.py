"""Pure PPO/VAPO terms against hand-computed numbers: clipped value loss, PPO clip with Clip-Higher and dual-clip,
positive-example NLL, explained variance, and the GAE pieces VAPO relies on (ragged masks, the lambda = 1 Monte-Carlo
identity, per-sequence lambdas, the length-adaptive lambda)."""

import math

import pytest
import torch

from trl_ppo_variants.advantages import gae, length_adaptive_lambda
from trl_ppo_variants.critic import explained_variance, is_critic_key, skip_critic_params, split_critic_state_dict
from trl_ppo_variants.losses import (
    aggregate_token_loss,
    clipped_value_loss,
    positive_example_nll,
    ppo_clip_policy_loss,
)


# ------------------------------------------------------------------------------------------------ value loss
def test_clipped_value_loss_hand_example():
    values = torch.tensor([[1.0, 0.0, 0.5]], requires_grad=True)
    old = torch.tensor([[0.5, 0.5, 0.5]])
    returns = torch.tensor([[2.0, 1.0, 0.5]])
    loss, clipped = clipped_value_loss(values, old, returns, 0.2)
    # t0: V=1 moved 0.5 away from V_old, clipped to 0.7: max((1-2)^2, (0.7-2)^2) = 1.69 -> the clipped term wins
    # t1: V=0 clipped to 0.3: max((0-1)^2, (0.3-1)^2) = 1 -> the unclipped term wins
    # t2: V = V_old = R: 0
    assert loss.tolist()[0] == pytest.approx([0.5 * 1.69, 0.5, 0.0])
    assert clipped.tolist() == [[True, False, False]]
    loss.sum().backward()
    # the clipped term is constant in V beyond the clip range: no gradient; unclipped: d/dV 0.5 (V-R)^2 = V - R
    assert values.grad.tolist()[0] == pytest.approx([0.0, -1.0, 0.0])


def test_clipped_value_loss_without_clipping_is_half_mse():
    values = torch.tensor([[1.0, -2.0]])
    loss, clipped = clipped_value_loss(values, torch.zeros(1, 2), torch.tensor([[0.0, 1.0]]), None)
    assert loss.tolist() == [[0.5, 4.5]]
    assert not clipped.any()


# ------------------------------------------------------------------------------------------------ policy loss
def _ppo(ratios, advantages, **kwargs):
    logps = torch.log(torch.tensor([ratios], dtype=torch.float64)).requires_grad_(True)
    old = torch.zeros_like(logps)
    loss, masks = ppo_clip_policy_loss(logps, old, torch.tensor([advantages], dtype=torch.float64), **kwargs)
    loss.sum().backward()
    return loss[0].tolist(), {k: v[0].tolist() for k, v in masks.items()}, logps.grad[0].tolist()


def test_ppo_clip_higher_and_dual_clip_hand_example():
    ratios = [0.5, 1.0, 1.5, 4.0, 2.0]
    advantages = [-1.0, -1.0, 1.0, -1.0, -2.0]
    loss, masks, grad = _ppo(ratios, advantages, epsilon_low=0.2, epsilon_high=0.28, clip_ratio_c=3.0)
    # r=0.5, A=-1: max(0.5, 0.8) = 0.8 (low clip, no gradient); r=1: 1; r=1.5, A=1: max(-1.5, -1.28) = -1.28 (high
    # clip at 1 + 0.28, no gradient); r=4, A=-1: max(4, 1.28) = 4 > c|A| = 3 -> dual-clipped to 3 (no gradient);
    # r=2, A=-2: max(4, 2.56) = 4 < c|A| = 6 -> unchanged, gradient -A r = 4
    assert loss == pytest.approx([0.8, 1.0, -1.28, 3.0, 4.0])
    assert masks["low"] == [True, False, False, False, False]
    assert masks["high"] == [False, False, True, False, False]
    assert masks["dual"] == [False, False, False, True, False]
    # d loss / d logp = -A r on unclipped tokens
    assert grad == pytest.approx([0.0, 1.0, 0.0, 0.0, 4.0])


def test_ppo_without_dual_clip_keeps_the_exploded_ratio():
    loss, masks, grad = _ppo([4.0], [-1.0], epsilon_low=0.2, epsilon_high=0.28)
    assert loss == pytest.approx([4.0]) and grad == pytest.approx([4.0])
    assert masks["dual"] == [False]
    # symmetric clip when epsilon_high is None
    loss, masks, _ = _ppo([1.25], [1.0], epsilon_low=0.2)
    assert loss == pytest.approx([-1.2]) and masks["high"] == [True]


def test_ppo_dual_clip_bound_must_exceed_one():
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_policy_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), 0.2, clip_ratio_c=1.0)


# ------------------------------------------------------------------------------------------------ positive NLL
def test_positive_example_nll_token_mean_over_correct_completions():
    logps = torch.tensor([[-1.0, -2.0, -9.0], [-0.5, -3.0, -4.0], [-1.0, -1.0, -1.0]], requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    positive = torch.tensor([True, False, True])
    nll, pos_mask = positive_example_nll(logps, mask, positive)
    assert pos_mask.tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]
    # the paper's L_NLL: sum of -log p over the tokens of correct completions / their number of tokens = (1+2+1)/3
    value = aggregate_token_loss(nll, pos_mask, "dapo", num_items_in_batch=pos_mask.sum())
    assert value.item() == pytest.approx(4.0 / 3.0)
    value.backward()
    expected = torch.tensor([[-1 / 3, -1 / 3, 0], [0, 0, 0], [-1 / 3, 0, 0]])
    assert torch.allclose(logps.grad, expected)


def test_positive_example_nll_is_zero_when_none_is_correct():
    logps = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    nll, pos_mask = positive_example_nll(logps, torch.ones(1, 2), torch.tensor([False]))
    value = aggregate_token_loss(nll, pos_mask, "dapo", num_items_in_batch=pos_mask.sum())
    assert value.item() == 0.0
    value.backward()
    assert torch.equal(logps.grad, torch.zeros(1, 2))  # no NaN from a 0/0


# ------------------------------------------------------------------------------------------------ metrics, keys
def test_explained_variance_hand_example():
    returns = torch.tensor([[1.0, 3.0, 99.0]])
    mask = torch.tensor([[1, 1, 0]])
    # Var[R] over valid = 1; perfect values -> 1; constant values at the mean -> 0; masked entry ignored
    assert explained_variance(returns, returns, mask).item() == pytest.approx(1.0)
    assert explained_variance(torch.full_like(returns, 2.0), returns, mask).item() == pytest.approx(0.0)
    # V = [1.5, 2.5]: R - V = [-0.5, 0.5], Var = 0.25 -> 1 - 0.25 / 1
    assert explained_variance(torch.tensor([[1.5, 2.5, 0.0]]), returns, mask).item() == pytest.approx(0.75)
    assert math.isnan(explained_variance(returns, torch.ones(1, 3), mask).item())
    # equal returns whose variance rounding makes ~1e-17 instead of 0 (all-wrong batches on the real model logged -6e13)
    torch.manual_seed(0)
    flat = torch.full((16, 24), 0.1) + torch.randn(16, 24) * 1e-9
    assert math.isnan(explained_variance(torch.randn(16, 24) * 0.05, flat, torch.ones(16, 24)).item())


def test_critic_keys_are_split_and_filtered():
    sd = {"model.embed_tokens.weight": 1, "critic.model.embed_tokens.weight": 2, "critic.score.bias": 3,
          "base_model.model.critic.score.weight": 4, "lm_head.weight": 5, "model.critical.weight": 6}
    policy, critic = split_critic_state_dict(sd)
    assert policy == {"model.embed_tokens.weight": 1, "lm_head.weight": 5, "model.critical.weight": 6}
    assert critic == {"model.embed_tokens.weight": 2, "score.bias": 3, "score.weight": 4}
    assert not is_critic_key("model.critical.weight")
    seen = []

    def named():  # every parameter must still be visited (ZeRO-3 gathers are collective)
        for name in ("model.a", "critic.model.a", "lm_head.weight"):
            seen.append(name)
            yield name, None

    assert [n for n, _ in skip_critic_params(named())] == ["model.a", "lm_head.weight"]
    assert seen == ["model.a", "critic.model.a", "lm_head.weight"]


# ------------------------------------------------------------------------------------------------ GAE (PPO/VAPO)
def test_gae_ragged_mask_hand_recursion():
    rewards = torch.tensor([[0.0, 0.0, 5.0, 1.0], [0.0, 2.0, 7.0, 7.0]])
    values = torch.tensor([[0.5, 0.2, 9.0, 0.4], [1.0, 1.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0, position 2 is a hole: the next valid token of t=1 is t=3. delta_3 = 1 - 0.4 = 0.6;
    # delta_1 = 0.9 * 0.4 - 0.2 = 0.16, A_1 = 0.16 + 0.72 * 0.6 = 0.592; delta_0 = 0.9 * 0.2 - 0.5 = -0.32,
    # A_0 = -0.32 + 0.72 * 0.592 = 0.10624. Row 1 ends at t=1: A_1 = 2 - 1 = 1, A_0 = 0.9 - 1 + 0.72 = 0.62
    assert adv.tolist()[0] == pytest.approx([0.10624, 0.592, 0.0, 0.6])
    assert adv.tolist()[1] == pytest.approx([0.62, 1.0, 0.0, 0.0])
    assert ret.tolist()[0] == pytest.approx([0.60624, 0.792, 0.0, 1.0])
    # per-sequence lambdas (length-adaptive GAE): row 1 with lambda 0 is one-step TD
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=torch.tensor([0.8, 0.0]))
    assert adv.tolist()[1] == pytest.approx([-0.1, 1.0, 0.0, 0.0])
    assert adv.tolist()[0] == pytest.approx([0.10624, 0.592, 0.0, 0.6])


def test_gae_lambda_one_is_monte_carlo_return_minus_value():
    torch.manual_seed(0)
    rewards, values = torch.randn(3, 5), torch.randn(3, 5)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    m = mask.float()
    mc = torch.flip(torch.cumsum(torch.flip(rewards * m, [1]), 1), [1])
    assert torch.allclose(adv, (mc - values) * m, atol=1e-5)
    assert torch.allclose(ret, mc * m, atol=1e-5)  # VAPO's critic targets with lam_critic = 1


def test_length_adaptive_lambda_at_paper_lengths():
    lam = length_adaptive_lambda(torch.tensor([1, 20, 100, 1000]), alpha=0.05)
    # 1 - 1 / (0.05 l): l = 1 -> -19, clamped to 0; l = 20 -> 0; l = 100 -> 0.8; l = 1000 -> 0.98
    assert lam.tolist() == pytest.approx([0.0, 0.0, 0.8, 0.98])
