"""Unit tests of every function in `trl_ppo_variants.advantages`, against hand-computed examples.

Layout in the examples: 2 prompts x 3 completions (rows 0-2 are prompt 0, rows 3-5 prompt 1), ragged masks.
Expected values are written out (or derived with plain arithmetic in the test), never with the function under test.
"""

import math

import pytest
import torch

from trl_ppo_variants.advantages import (
    gae,
    grpo_advantages,
    grpo_process_advantages,
    group_view,
    kl_estimate,
    length_adaptive_lambda,
    masked_mean,
    masked_whiten,
    normalize_then_sum_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    remax_advantages,
    rloo_advantages,
    token_rewards_from_outcome,
    token_rewards_from_steps,
)

NAN = float("nan")
EPS = 1e-4  # grpo_advantages' default, TRL's constant


def t(x):
    return torch.tensor(x, dtype=torch.float32)


def close(actual, expected, atol=1e-6):
    torch.testing.assert_close(actual, t(expected) if not isinstance(expected, torch.Tensor) else expected,
                               rtol=0, atol=atol)


def whiten_by_hand(values):
    """(x - mean) / sqrt(unbiased var + 1e-8) of a plain list: the statistics masked_whiten must reproduce."""
    n = len(values)
    mean = sum(values) / n
    var = sum((v - mean) ** 2 for v in values) / (n - 1)
    return [(v - mean) / math.sqrt(var + 1e-8) for v in values]


# Rewards of the 2 x 3 batch: group 0 spread, group 1 all equal.
REWARDS = t([1.0, 0.0, 2.0, 3.0, 3.0, 3.0])


# --------------------------------------------------------------------------------------------- group_view
def test_group_view_shapes_and_errors():
    assert group_view(REWARDS, 3).shape == (2, 3)
    assert group_view(REWARDS, 3)[1].tolist() == [3.0, 3.0, 3.0]
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        group_view(REWARDS, 4)
    with pytest.raises(ValueError, match="group_size must be >= 1"):
        group_view(REWARDS, 0)


# --------------------------------------------------------------------------------------------- grpo
def test_grpo_group_scale_hand_computed():
    # group 0: mean 1, sample std sqrt((0 + 1 + 1) / 2) = 1; group 1: all equal -> 0
    close(grpo_advantages(REWARDS, 3, "group"), [0.0, -1 / (1 + EPS), 1 / (1 + EPS), 0.0, 0.0, 0.0])


def test_grpo_batch_scale_hand_computed():
    # centred on the group mean, divided by the batch's sample std: mean 2, squares 1+4+0+1+1+1 = 8, var 8/5
    std = math.sqrt(8 / 5)
    close(grpo_advantages(REWARDS, 3, "batch"), [0.0, -1 / (std + EPS), 1 / (std + EPS), 0.0, 0.0, 0.0])


def test_grpo_no_scale_hand_computed():
    close(grpo_advantages(REWARDS, 3, "none"), [0.0, -1.0, 1.0, 0.0, 0.0, 0.0])


def test_grpo_nan_rows_are_zero_and_left_out_of_the_statistics():
    rewards = t([1.0, NAN, 3.0, 5.0, NAN, NAN])
    # group 0 over {1, 3}: mean 2, std sqrt(2); group 1 has one finite reward: std undefined -> 0
    s = math.sqrt(2)
    close(grpo_advantages(rewards, 3, "group"), [-1 / (s + EPS), 0.0, 1 / (s + EPS), 0.0, 0.0, 0.0])
    # batch std over {1, 3, 5}: 2
    close(grpo_advantages(rewards, 3, "batch"), [-1 / (2 + EPS), 0.0, 1 / (2 + EPS), 0.0, 0.0, 0.0])
    all_nan = torch.full((6,), NAN)
    for scale in ("group", "batch", "none"):
        assert torch.equal(grpo_advantages(all_nan, 3, scale), torch.zeros(6))


def test_grpo_group_size_one_and_bad_scale():
    assert torch.equal(grpo_advantages(t([1.0, 2.0]), 1, "group"), torch.zeros(2))
    with pytest.raises(ValueError, match="scale must be one of"):
        grpo_advantages(REWARDS, 3, "std")


# --------------------------------------------------------------------------------------------- normalize_then_sum
def test_normalize_then_sum_hand_computed():
    """G = 2, two functions, weights (1, 2). Group 0: function 0 = (1, 0), function 1 constant; group 1: function 0
    unknown, function 1 = (2, 4); group 2: row 4 unscorable, row 5 alone in both functions (no std: its normalised
    rewards are dropped and its sum is 0, as in TRL)."""
    rewards = t([[1.0, 0.0], [0.0, 0.0], [NAN, 2.0], [NAN, 4.0], [NAN, NAN], [3.0, 1.0]])
    a = 0.5 / (math.sqrt(0.5) + EPS)  # (1 - 0.5) / sample std of (1, 0)
    b = 2 * 1.0 / (math.sqrt(2.0) + EPS)  # weight 2 x (4 - 3) / sample std of (2, 4)
    sums = [a, -a, -b, b, 0.0]  # the scorable rows; mean 0
    std = math.sqrt(sum(x * x for x in sums) / (len(sums) - 1))
    expected = [x / (std + EPS) for x in sums[:4]] + [0.0, 0.0]
    close(normalize_then_sum_advantages(rewards, t([1.0, 2.0]), 2), expected, atol=1e-5)


def test_normalize_then_sum_single_function_is_group_then_batch_normalisation():
    """With one reward function the aggregation is GRPO's group normalisation followed by a batch whitening, and a
    group of one sample carries no signal (0), as TRL computes it."""
    rewards = REWARDS.unsqueeze(1)
    grouped = grpo_advantages(REWARDS, 3)
    finite = grouped[~torch.isnan(grouped)]
    expected = (grouped - finite.mean()) / (finite.std() + EPS)
    close(normalize_then_sum_advantages(rewards, t([1.0]), 3), expected, atol=1e-6)
    close(normalize_then_sum_advantages(rewards, t([1.0]), 1), [0.0] * 6)
    with pytest.raises(ValueError, match="weights must have shape"):
        normalize_then_sum_advantages(rewards, t([1.0, 1.0]), 3)
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        normalize_then_sum_advantages(rewards, t([1.0]), 4)


# --------------------------------------------------------------------------------------------- rloo
def test_rloo_hand_computed():
    # baselines of group 0: (0+2)/2, (1+2)/2, (1+0)/2
    close(rloo_advantages(REWARDS, 3), [0.0, -1.5, 1.5, 0.0, 0.0, 0.0])


def test_rloo_nan_rows():
    rewards = t([1.0, NAN, 3.0, 5.0, NAN, NAN])
    # group 0: each finite row's baseline is the other finite row; group 1: a lone finite row has no baseline
    close(rloo_advantages(rewards, 3), [-2.0, 0.0, 2.0, 0.0, 0.0, 0.0])
    assert torch.isfinite(rloo_advantages(torch.full((6,), NAN), 3)).all()


def test_rloo_group_sums_to_zero():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(40, generator=gen)
    for g in (2, 4, 5, 8):
        sums = rloo_advantages(rewards, g).view(-1, g).sum(dim=1)
        torch.testing.assert_close(sums, torch.zeros_like(sums), rtol=0, atol=1e-5)


def test_rloo_equals_scaled_mean_centering():
    # an identity of the estimator: r_i - mean_{j != i} r_j = G / (G - 1) * (r_i - mean_group)
    gen = torch.Generator().manual_seed(1)
    rewards = torch.randn(12, generator=gen)
    expected = 4 / 3 * (rewards.view(-1, 4) - rewards.view(-1, 4).mean(1, keepdim=True)).reshape(-1)
    torch.testing.assert_close(rloo_advantages(rewards, 4), expected, rtol=0, atol=1e-6)


def test_rloo_needs_two():
    with pytest.raises(ValueError, match="group_size >= 2"):
        rloo_advantages(REWARDS, 1)


# --------------------------------------------------------------------------------------------- remax
def test_remax_hand_computed():
    close(remax_advantages(REWARDS, t([0.5, 3.0]), 3), [0.5, -0.5, 1.5, 0.0, 0.0, 0.0])


def test_remax_nan_greedy_and_nan_rows():
    close(remax_advantages(t([1.0, NAN, 2.0, 3.0, 4.0, 5.0]), t([0.5, NAN]), 3), [0.5, 0.0, 1.5, 0.0, 0.0, 0.0])


def test_remax_shape_error():
    with pytest.raises(ValueError, match=r"greedy_rewards must have shape \(2,\)"):
        remax_advantages(REWARDS, t([0.5, 3.0, 1.0]), 3)


# --------------------------------------------------------------------------------------------- masked_mean / whiten
def test_masked_mean_ignores_garbage_at_masked_positions():
    x = t([[1.0, 2.0, NAN], [4.0, float("inf"), NAN]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    close(masked_mean(x, mask), 7 / 3)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_masked_whiten_uses_bessel_corrected_variance():
    x = t([[1.0, 2.0, NAN], [3.0, 100.0, -7.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # valid values 1, 2, 3: mean 2, unbiased variance 1 (the population variance would be 2/3)
    s = math.sqrt(1 + 1e-8)
    close(masked_whiten(x, mask), [[-1 / s, 0.0, 0.0], [1 / s, 0.0, 0.0]])


def test_masked_whiten_degenerate():
    assert torch.equal(masked_whiten(t([[5.0, 1.0]]), torch.tensor([[1, 0]])), torch.zeros(1, 2))
    assert torch.equal(masked_whiten(t([[5.0, 1.0]]), torch.tensor([[0, 0]])), torch.zeros(1, 2))
    assert torch.equal(masked_whiten(t([[2.0, 2.0, 2.0]]), torch.ones(1, 3)), torch.zeros(1, 3))


# --------------------------------------------------------------------------------------------- kl_estimate
def test_kl_estimators_hand_computed():
    logp, ref = t([-1.0, -2.0, -0.3]), t([-1.5, -1.0, -0.3])  # log-ratio 0.5, -1, 0
    close(kl_estimate(logp, ref, "k1"), [0.5, -1.0, 0.0])
    close(kl_estimate(logp, ref, "k2"), [0.125, 0.5, 0.0])
    close(kl_estimate(logp, ref, "k3"), [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1 - 1, 0.0])
    with pytest.raises(ValueError, match="kind must be one of"):
        kl_estimate(logp, ref, "k4")


def test_kl_estimators_k2_k3_non_negative():
    gen = torch.Generator().manual_seed(0)
    logp, ref = torch.randn(100, generator=gen), torch.randn(100, generator=gen)
    assert (kl_estimate(logp, ref, "k2") >= 0).all()
    assert (kl_estimate(logp, ref, "k3") >= 0).all()


# --------------------------------------------------------------------------------------------- token rewards
def test_token_rewards_from_outcome_hand_computed():
    rewards = t([1.0, NAN, 2.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    kl = t([[0.1, 0.2, NAN], [0.3, 0.3, 0.3], [1.0, 1.0, 1.0]])
    out = token_rewards_from_outcome(rewards, mask, kl, kl_coef=0.5)
    # row 0: -0.5 * kl, outcome at the last valid token; row 1 unscorable; row 2 has no token to carry its reward
    close(out, [[-0.05, -0.1 + 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    close(token_rewards_from_outcome(rewards, mask), [[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_token_rewards_from_steps_hand_computed():
    step_rewards = t([[0.5, 2.0, NAN], [1.0, -1.0, 3.0], [NAN, NAN, NAN]])
    step_ends = torch.tensor([[1, 3, 99], [0, 2, 3], [7, 7, 7]])  # 99 and 7 sit where the reward is NaN: ignored
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 1], [1, 1, 1, 1]])
    out = token_rewards_from_steps(step_rewards, step_ends, mask)
    # row 1: the step ending on masked token 2 is credited to token 0, the last valid token at or before it
    close(out, [[0.0, 0.5, 0.0, 2.0], [1.0 - 1.0, 0.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    # a step ending before any valid token has no action to credit: dropped; two steps may end on one token
    out = token_rewards_from_steps(t([[4.0, 1.0, 2.0]]), torch.tensor([[0, 2, 2]]), torch.tensor([[0, 1, 1]]))
    close(out, [[0.0, 0.0, 3.0]])
    with pytest.raises(ValueError, match="step_ends must lie in"):
        token_rewards_from_steps(t([[1.0]]), torch.tensor([[4]]), torch.ones(1, 4))
    with pytest.raises(ValueError, match="must both have shape"):
        token_rewards_from_steps(t([[1.0, 2.0]]), torch.tensor([[1]]), torch.ones(1, 4))


# --------------------------------------------------------------------------------------------- process GRPO
def test_grpo_process_seed_example():
    """The seed chapter's example (3.4.1): one output whose steps the PRM grades 0.1, 0.2, 0.5, 1.0, two tokens per
    step. "After normalization, the final token reward is highest, and earlier tokens see the sum of their own and
    future rewards." The normalisation is over the group's step rewards (here the four of this output)."""
    rewards = [0.1, 0.2, 0.5, 1.0]
    mean = sum(rewards) / 4  # 0.45
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / 3)  # sample std, sqrt(0.49 / 3)
    normed = [(r - mean) / (std + EPS) for r in rewards]  # -0.866, -0.619, 0.124, 1.361
    out = grpo_process_advantages(t([rewards]), torch.tensor([[1, 3, 5, 7]]), torch.ones(1, 8), group_size=1)
    expected = [sum(normed[j:]) for j in (0, 0, 1, 1, 2, 2, 3, 3)]
    close(out, [expected], atol=1e-5)
    assert max(normed) == normed[-1]  # the final step's normalised reward is the highest
    # its tokens' advantage is that reward alone; the third step's tokens add their own (positive) one: with a single
    # output the last step's tokens do NOT get the largest advantage, and the first step's get 0 (normalised sum)
    assert out[0, 6] == pytest.approx(normed[3], abs=1e-6) and out[0, 4] > out[0, 6]
    assert out[0, 0] == pytest.approx(0.0, abs=1e-5)
    # beside a sibling that scores better (group mean step reward 0.675 > 0.5), the third step's normalised reward is
    # negative and the last step's tokens get the largest advantage of the example's output
    sibling = [0.8, 0.9, 0.9, 1.0]
    group = rewards + sibling
    mean = sum(group) / 8
    std = math.sqrt(sum((r - mean) ** 2 for r in group) / 7)
    normed = [(r - mean) / (std + EPS) for r in rewards]
    out = grpo_process_advantages(t([rewards, sibling]), torch.tensor([[1, 3, 5, 7]] * 2), torch.ones(2, 8), 2)
    close(out[0], [sum(normed[j:]) for j in (0, 0, 1, 1, 2, 2, 3, 3)], atol=1e-5)
    assert out[0].argmax() >= 6 and normed[2] < 0


def test_grpo_process_ragged_group_hand_computed():
    # one group of 2 outputs: output 0 has steps (1, 0) ending at tokens 1 and 3, its token 4 is padding; output 1 has
    # one step (1) ending at token 2, its second slot is NaN (its end, 99, is ignored), tokens 3-4 are padding.
    step_rewards = t([[1.0, 0.0], [1.0, NAN]])
    step_ends = torch.tensor([[1, 3], [2, 99]])
    mask = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
    # the group's step rewards {1, 0, 1}: mean 2/3, sample std sqrt(((1/3)^2 * 2 + (2/3)^2) / 2) = sqrt(1/3)
    std = math.sqrt(1 / 3)
    hi, lo = (1 / 3) / (std + EPS), (-2 / 3) / (std + EPS)
    out = grpo_process_advantages(step_rewards, step_ends, mask, group_size=2)
    close(out, [[hi + lo, hi + lo, lo, lo, 0.0], [hi, hi, hi, 0.0, 0.0]], atol=1e-6)


def test_grpo_process_zero_cases():
    mask = torch.ones(6, 3)
    ends = torch.tensor([[0, 2]] * 6)
    step_rewards = t([
        [1.0, 2.0], [NAN, NAN], [3.0, 0.0],  # group 0: output 1 has no step reward -> 0; the others are normalised
        [NAN, NAN], [5.0, NAN], [NAN, NAN],  # group 1: a single step reward -> no std -> 0
    ])
    out = grpo_process_advantages(step_rewards, ends, mask, group_size=3)
    assert torch.equal(out[1], torch.zeros(3)) and torch.equal(out[3:], torch.zeros(3, 3))
    assert out[0].abs().sum() > 0 and out[2].abs().sum() > 0
    equal = grpo_process_advantages(t([[2.0, 2.0]] * 6), ends, mask, group_size=3)  # all equal: no ranking signal
    assert torch.equal(equal, torch.zeros(6, 3))
    assert torch.equal(grpo_process_advantages(torch.zeros(6, 0), torch.zeros(6, 0, dtype=torch.long), mask, 3),
                       torch.zeros(6, 3))
    with pytest.raises(ValueError, match="not a multiple of group_size"):
        grpo_process_advantages(step_rewards, ends, mask, group_size=4)
    with pytest.raises(ValueError, match="step_ends must lie in"):
        grpo_process_advantages(step_rewards, ends + 1, mask, group_size=3)


def test_grpo_process_masked_step_end_and_tokens_after_the_last_step():
    # tokens 0, 2, 3 are valid; the first step ends on masked token 1, the second at token 2; token 3 comes after the
    # last step end: 0. Group of 2 outputs, the second with one step of reward 0.
    rewards = t([[2.0, 1.0], [0.0, NAN]])
    mask = torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]])
    out = grpo_process_advantages(rewards, torch.tensor([[1, 2], [3, 0]]), mask, group_size=2)
    mean, std = 1.0, 1.0  # {2, 1, 0}
    a, b, c = (2 - mean) / (std + EPS), (1 - mean) / (std + EPS), (0 - mean) / (std + EPS)
    close(out, [[a + b, 0.0, b, 0.0], [c, c, c, c]], atol=1e-6)


def test_grpo_process_with_one_step_per_output_is_grpo():
    """One step per output ending at its last token: the group's statistics are GRPO's, so is every advantage."""
    rewards = t([1.0, 0.0, 2.0, 3.0, 3.0, NAN])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 1], [1, 1, 0], [1, 0, 0]])
    last = (mask.cumsum(1) == mask.sum(1, keepdim=True)).long().argmax(1)
    out = grpo_process_advantages(rewards.unsqueeze(1), last.unsqueeze(1), mask, group_size=3)
    close(out, grpo_advantages(rewards, 3).unsqueeze(1) * mask, atol=1e-6)


# --------------------------------------------------------------------------------------------- REINFORCE++
RPP_MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
RPP_KL = t([[0.1, 0.2, 0.3], [0.4, 0.5, 99.0]])  # 99 sits at a masked position


def test_reinforce_pp_hand_computed_gamma_one():
    # token rewards: row 0 [-0.05, -0.1, -0.15 + 1], row 1 [-0.2, -0.25 + 0]; reverse cumulative sums:
    returns = [0.7, 0.75, 0.85, -0.45, -0.25]
    w = whiten_by_hand(returns)
    out = reinforce_pp_advantages(t([1.0, 0.0]), RPP_MASK, kl=RPP_KL, kl_coef=0.5, gamma=1.0)
    close(out, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]], atol=1e-5)


def test_reinforce_pp_hand_computed_gamma_half():
    # G_t = r_t + 0.5 G_{t+1}: row 0: 0.85, -0.1 + 0.425, -0.05 + 0.1625; row 1: -0.25, -0.2 - 0.125
    returns = [0.1125, 0.325, 0.85, -0.325, -0.25]
    w = whiten_by_hand(returns)
    out = reinforce_pp_advantages(t([1.0, 0.0]), RPP_MASK, kl=RPP_KL, kl_coef=0.5, gamma=0.5)
    close(out, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]], atol=1e-5)


def test_reinforce_pp_masked_gap_is_not_a_discount_step():
    # a tool-output token in the middle (mask 0) neither carries reward nor counts as a step of the discount
    mask = torch.tensor([[1, 0, 1], [1, 1, 1]])
    out = reinforce_pp_advantages(t([1.0, 0.0]), mask, gamma=0.5)
    w = whiten_by_hand([0.5, 1.0, 0.0, 0.0, 0.0])
    close(out, [[w[0], 0.0, w[1]], [w[2], w[3], w[4]]], atol=1e-5)


def test_reinforce_pp_nan_rows_and_masked_values():
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0]])
    kl = t([[0.1, 0.2, 0.3], [0.4, 0.5, 0.0], [7.0, 0.0, 0.0]])
    base = reinforce_pp_advantages(t([1.0, 0.0, NAN]), mask, kl=kl, kl_coef=0.5)
    assert torch.equal(base[2], torch.zeros(3))  # unscorable row: 0, and excluded from whitening
    close(base[:2], reinforce_pp_advantages(t([1.0, 0.0]), RPP_MASK, kl=RPP_KL, kl_coef=0.5), atol=1e-6)
    garbage = kl.clone()
    garbage[mask == 0] = NAN
    assert torch.equal(reinforce_pp_advantages(t([1.0, 0.0, NAN]), mask, kl=garbage, kl_coef=0.5), base)


def test_reinforce_pp_with_step_token_rewards_hand_computed():
    # row 0: outcome 1 at token 2 plus a step reward 0.5 at token 0; row 1: outcome 0, step reward -1 at token 1.
    step = token_rewards_from_steps(t([[0.5], [-1.0]]), torch.tensor([[0], [1]]), RPP_MASK)
    # token rewards with the k1 KL: row 0 [-0.05 + 0.5, -0.1, -0.15 + 1], row 1 [-0.2, -0.25 - 1]; returns:
    returns = [1.2, 0.75, 0.85, -1.45, -1.25]
    w = whiten_by_hand(returns)
    out = reinforce_pp_advantages(t([1.0, 0.0]), RPP_MASK, kl=RPP_KL, kl_coef=0.5, token_rewards=step)
    close(out, [[w[0], w[1], w[2]], [w[3], w[4], 0.0]], atol=1e-5)
    # NaN rows stay unscorable whatever their step rewards (the trainers turn such an outcome into 0 first)
    out = reinforce_pp_advantages(t([1.0, NAN]), RPP_MASK, token_rewards=step)
    assert torch.equal(out[1], torch.zeros(3))


# --------------------------------------------------------------------------------------------- REINFORCE++-baseline
BASE_MASK = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0], [1, 1, 1], [1, 0, 0]])


def test_reinforce_pp_baseline_hand_computed():
    rewards = t([1.0, 0.0, 2.0, 4.0, 4.0, 1.0])
    # r - group mean: group 0 [0, -1, 1], group 1 (mean 3) [1, 1, -2]; broadcast to 3, 1, 2, 2, 3, 1 valid tokens
    centered = [0.0, -1.0, 1.0, 1.0, 1.0, -2.0]
    lengths = BASE_MASK.sum(1).tolist()
    flat = [c for c, n in zip(centered, lengths) for _ in range(n)]
    w = iter(whiten_by_hand(flat))
    expected = [[next(w) if j < n else 0.0 for j in range(3)] for n in lengths]
    close(reinforce_pp_baseline_advantages(rewards, BASE_MASK, 3), expected, atol=1e-5)


def test_reinforce_pp_baseline_all_equal_groups_and_nan():
    assert torch.equal(reinforce_pp_baseline_advantages(t([2.0] * 6), BASE_MASK, 3), torch.zeros(6, 3))
    out = reinforce_pp_baseline_advantages(t([1.0, NAN, 3.0, NAN, NAN, NAN]), BASE_MASK, 3)
    assert torch.isfinite(out).all()
    assert torch.equal(out[1], torch.zeros(3)) and torch.equal(out[3:], torch.zeros(3, 3))
    # group 0 over {1, 3}: centred [-1, +1] on 3 and 2 tokens -> whitened
    w = whiten_by_hand([-1.0] * 3 + [1.0] * 2)
    close(out[0], w[:3], atol=1e-5)
    close(out[2], w[3:] + [0.0], atol=1e-5)


def test_reinforce_pp_baseline_is_zero_on_masked_positions_for_any_mask_dtype():
    rewards = t([1.0, 0.0, 2.0, 4.0, 4.0, 1.0])
    a = reinforce_pp_baseline_advantages(rewards, BASE_MASK, 3)
    b = reinforce_pp_baseline_advantages(rewards, BASE_MASK.bool(), 3)
    c = reinforce_pp_baseline_advantages(rewards, BASE_MASK.float(), 3)
    assert torch.equal(a, b) and torch.equal(a, c) and (a[BASE_MASK == 0] == 0).all()


# --------------------------------------------------------------------------------------------- GAE
def test_gae_hand_recursion_ragged():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 5.0], [0.0, 5.0, 1.0]])
    values = t([[0.5, 0.6, 0.7], [0.1, 0.2, 9.0], [0.2, 9.0, 0.4]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 1]])
    adv, ret = gae(rewards, values, mask, gamma=0.9, lam=0.8)
    # row 0: d2 = 1 - .7 = .3; d1 = .9*.7 - .6 = .03, A1 = .03 + .72*.3; d0 = .9*.6 - .5 = .04, A0 = .04 + .72*A1
    a1 = 0.03 + 0.72 * 0.3
    a0 = 0.04 + 0.72 * a1
    # row 1 (last token masked): d1 = 2 - .2 = 1.8; d0 = .9*.2 - .1 = .08, A0 = .08 + .72*1.8
    # row 2 (middle token masked, skipped): d2 = 1 - .4 = .6; d0 = .9*.4 - .2 = .16, A0 = .16 + .72*.6
    expected = [[a0, a1, 0.3], [0.08 + 0.72 * 1.8, 1.8, 0.0], [0.16 + 0.72 * 0.6, 0.0, 0.6]]
    close(adv, expected, atol=1e-6)
    close(ret, (t(expected) + values) * mask, atol=1e-6)


def test_gae_per_sequence_lambda():
    rewards = t([[0.0, 0.0, 1.0], [0.0, 2.0, 0.0]])
    values = t([[0.5, 0.6, 0.7], [0.1, 0.2, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, _ = gae(rewards, values, mask, gamma=0.9, lam=t([0.0, 1.0]))
    # lam 0: one-step TD errors; lam 1: A0 = d0 + 0.9 * d1
    close(adv, [[0.04, 0.03, 0.3], [0.08 + 0.9 * 1.8, 1.8, 0.0]], atol=1e-6)
    with pytest.raises(ValueError, match="lam must be a float or have shape"):
        gae(rewards, values, mask, lam=t([0.5, 0.5, 0.5]))


def test_gae_monte_carlo_identity_and_masked_garbage():
    gen = torch.Generator().manual_seed(0)
    rewards, values = torch.randn(4, 6, generator=gen), torch.randn(4, 6, generator=gen)
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [1, 0, 1, 1, 0, 0], [0] * 6])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    m = mask.float()
    mc = torch.flip(torch.cumsum(torch.flip(rewards * m, [1]), 1), [1])  # sum of valid rewards from t on
    torch.testing.assert_close(adv, (mc - values) * m, rtol=0, atol=1e-5)
    torch.testing.assert_close(ret, mc * m, rtol=0, atol=1e-5)
    r2, v2 = rewards.clone(), values.clone()
    r2[mask == 0], v2[mask == 0] = NAN, NAN
    adv2, ret2 = gae(r2, v2, mask, gamma=0.9, lam=0.7)
    adv1, ret1 = gae(rewards, values, mask, gamma=0.9, lam=0.7)
    assert torch.equal(adv1, adv2) and torch.equal(ret1, ret2)


# --------------------------------------------------------------------------------------------- VAPO lambda
def test_length_adaptive_lambda():
    lam = length_adaptive_lambda(torch.tensor([1, 20, 100, 1000, 0]), alpha=0.05)
    # 1 - 1 / (0.05 l): -19 -> clamped 0; 0; 0.8; 0.98; length 0 -> 0
    close(lam, [0.0, 0.0, 0.8, 0.98, 0.0])
    with pytest.raises(ValueError, match="alpha must be > 0"):
        length_adaptive_lambda(torch.tensor([10]), alpha=0.0)


# --------------------------------------------------------------------------------------------- shared properties
@pytest.mark.parametrize(
    "fn",
    [
        lambda r: grpo_advantages(r, 3, "group"),
        lambda r: grpo_advantages(r, 3, "batch"),
        lambda r: grpo_advantages(r, 3, "none"),
        lambda r: rloo_advantages(r, 3),
        lambda r: remax_advantages(r, torch.nan_to_num(r.view(-1, 3)[:, 0], nan=0.0), 3),
    ],
    ids=["grpo-group", "grpo-batch", "grpo-none", "rloo", "remax"],
)
def test_nan_and_all_equal_groups_give_zero(fn):
    all_equal = t([0.5, 0.5, 0.5, 2.0, 2.0, 2.0])
    assert torch.equal(fn(all_equal), torch.zeros(6))
    with_nan = t([NAN, NAN, NAN, 1.0, NAN, 1.0])
    out = fn(with_nan)
    assert torch.isfinite(out).all() and torch.equal(out, torch.zeros(6))
