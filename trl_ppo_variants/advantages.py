"""Advantage estimators: pure torch functions, no Trainer, no accelerator, no config objects.

Layout convention (TRL's): the `G` completions of one prompt are consecutive rows, so a batch of `N` rows holds
`N // G` groups. Shapes: `N` rows, `T` completion tokens, `mask` is 1 on valid completion tokens and 0 on padding.

Failure semantics shared by every estimator:
- a NaN reward (a reward function returned None for that completion) gives that row advantage 0 and is left out of
  every baseline and every normalisation statistic;
- a group whose rewards are all equal gives advantage 0 (never NaN): it carries no ranking signal. The REINFORCE++
  estimators then whiten over the whole batch (the paper's Eq. 6 and 8): such a group is 0 before that step and
  receives the batch-wide shift `-mean / std` after it (0 when every group is all-equal).
"""

from __future__ import annotations

import torch

__all__ = [
    "grpo_advantages",
    "normalize_then_sum_advantages",
    "grpo_process_advantages",
    "rloo_advantages",
    "remax_advantages",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "masked_whiten",
    "masked_mean",
    "kl_estimate",
    "gae",
    "length_adaptive_lambda",
    "token_rewards_from_outcome",
    "token_rewards_from_steps",
    "group_view",
]

KL_KINDS = ("k1", "k2", "k3")
SCALE_KINDS = ("group", "batch", "none")


def group_view(x: torch.Tensor, group_size: int) -> torch.Tensor:
    """(N,) -> (N // G, G); raises a clear error when N is not a multiple of G."""
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if x.shape[0] % group_size != 0:
        raise ValueError(f"the number of rows ({x.shape[0]}) is not a multiple of group_size ({group_size})")
    return x.view(-1, group_size)


def _nan_std(x: torch.Tensor, dim: int | None = None, keepdim: bool = False) -> torch.Tensor:
    """Sample (Bessel-corrected) standard deviation ignoring NaNs; NaN where fewer than 2 values are finite.

    The operations are ordered as in `trl.trainer.utils.nanstd` (mean of squares, then the `n / (n - 1)` factor), so
    that `grpo_advantages` reproduces `GRPOTrainer` bit for bit rather than to a few ulps.

    Args:
        x: any shape.
        dim: the dimension to reduce, or None for all of them.
    Returns:
        `x` reduced over `dim` (kept as size 1 when `keepdim`), a 0-dim tensor when `dim` is None and not `keepdim`.
    """
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = (~torch.isnan(x)).sum(dim=dim, keepdim=True)
    factor = torch.where(count > 1, count / (count - 1), torch.full_like(var, float("nan")))
    std = (var * factor).sqrt()
    if keepdim:
        return std
    return std.reshape(()) if dim is None else std.squeeze(dim)


def grpo_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group", eps: float = 1e-4) -> torch.Tensor:
    """GRPO advantages (arXiv 2402.03300), exactly as TRL's `GRPOTrainer` computes them.

    `A_i = (r_i - mean_group) / (std + eps)` with the sample standard deviation; `std` is the group's for
    `scale="group"`, the whole batch's for `scale="batch"`, and no division at all for `scale="none"`.

    Args:
        rewards: (N,) float, NaN for unscorable rows.
        group_size: G.
    Returns:
        (N,) advantages; 0 for NaN rewards.
    """
    if scale not in SCALE_KINDS:
        raise ValueError(f"scale must be one of {SCALE_KINDS}, got {scale!r}")
    grouped = group_view(rewards, group_size)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    adv = grouped - mean
    if scale == "group":
        std = _nan_std(grouped, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        adv = adv / (std + eps)
    elif scale == "batch":
        std = _nan_std(rewards) if rewards.numel() > 1 else torch.zeros((), dtype=rewards.dtype)
        adv = adv / (std + eps)
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)


def normalize_then_sum_advantages(
    rewards_per_func: torch.Tensor, weights: torch.Tensor, group_size: int, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO advantages with GDPO's aggregation (arXiv 2601.05242), as TRL's `GRPOTrainer` computes them for
    `multi_objective_aggregation="normalize_then_sum"`.

    1. each reward function k is normalised within each group: `z_ik = (r_ik - mean_group_k) / (std_group_k + eps)`
       (sample std; a function with fewer than 2 finite values in the group gives NaN, dropped in step 2; a
       function equal over the group, or any function when `group_size` is 1, gives 0);
    2. the weighted sum over the functions, ignoring NaN: `s_i = sum_k w_k z_ik`, NaN when every function of row i is
       NaN (unscorable);
    3. the sums are normalised over the whole batch: `A_i = (s_i - mean(s)) / (std(s) + eps)` (sample std; 0 when
       fewer than 2 rows are scorable). `scale_rewards` is not used, as in TRL.

    Args:
        rewards_per_func: (N, F) raw rewards, NaN where a function returned None.
        weights: (F,) reward weights.
        group_size: G.
    Returns:
        (N,) advantages; 0 for unscorable rows.
    """
    n, num_funcs = rewards_per_func.shape
    if weights.shape != (num_funcs,):
        raise ValueError(f"weights must have shape ({num_funcs},), got {tuple(weights.shape)}")
    group_view(rewards_per_func[:, 0], group_size)  # the row count must split into groups
    grouped = rewards_per_func.view(-1, group_size, num_funcs)
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = _nan_std(grouped, dim=1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    normalized = ((grouped - mean) / (std + eps)).view(n, num_funcs)
    summed = (normalized * weights.to(normalized).unsqueeze(0)).nansum(dim=1)
    summed[torch.isnan(rewards_per_func).all(dim=1)] = float("nan")
    batch_std = _nan_std(summed) if n > 1 else torch.zeros((), dtype=summed.dtype, device=summed.device)
    advantages = (summed - torch.nanmean(summed)) / (batch_std + eps)
    return torch.nan_to_num(advantages, nan=0.0)


def grpo_process_advantages(
    step_rewards: torch.Tensor, step_ends: torch.Tensor, mask: torch.Tensor, group_size: int, eps: float = 1e-4
) -> torch.Tensor:
    """GRPO with process supervision (DeepSeekMath, arXiv 2402.03300, Sec. 4.1.3).

    Every step reward of a group is normalised with the mean and the sample standard deviation of ALL step rewards of
    the G outputs of that prompt, `r~ = (r - mean) / (std + eps)`, and a token's advantage is the sum of the
    normalised rewards of the steps of its output that end at or after that token:
    `A_{i,t} = sum_{j : index(j) >= t} r~_i^{index(j)}`.

    Tokens after an output's last step end, masked tokens and outputs without any finite step reward get 0; a group
    with fewer than 2 finite step rewards (no standard deviation) gets 0, and so does a group whose step rewards are
    all equal. `eps` and the Bessel-corrected std are GRPO's (`grpo_advantages`).

    Args:
        step_rewards: (N, S) float, NaN where an output has fewer than S steps or a step is unscored.
        step_ends: (N, S) long, index in [0, T) of the last completion token of each step; ignored where NaN.
        mask: (N, T)
        group_size: G; the G outputs of a prompt are consecutive rows.
    Returns:
        (N, T) advantages.
    """
    if step_rewards.dim() != 2:
        raise ValueError(f"step_rewards must have shape (N, S), got {tuple(step_rewards.shape)}")
    n, num_steps = step_rewards.shape
    group_view(step_rewards.new_zeros(n), group_size)  # the row-count and group-size errors of every estimator
    if num_steps == 0:
        return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    rewards = step_rewards.to(torch.float32)
    rewards = torch.where(torch.isfinite(rewards), rewards, torch.full_like(rewards, float("nan")))
    grouped = rewards.reshape(n // group_size, group_size * num_steps)  # all step rewards of a prompt's outputs
    mean = torch.nanmean(grouped, dim=1, keepdim=True)
    std = _nan_std(grouped, dim=1, keepdim=True)  # NaN for fewer than 2 rewards: the group's steps stay NaN
    normalised = ((grouped - mean) / (std + eps)).reshape(n, num_steps)
    token_rewards = token_rewards_from_steps(normalised, step_ends, mask)
    return _discounted_returns(token_rewards, mask, 1.0)


def rloo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE Leave-One-Out advantages (arXiv 2402.14740): `A_i = r_i - (sum_group - r_i) / (G - 1)`.

    With NaN rewards the baseline averages the scorable siblings only; a row with no scorable sibling gets 0.
    The advantages of a fully scorable group sum to 0.

    Args:
        rewards: (N,), NaN for unscorable rows.
    Returns:
        (N,)
    """
    if group_size < 2:
        raise ValueError(f"RLOO needs group_size >= 2 (a leave-one-out baseline), got {group_size}")
    grouped = group_view(rewards, group_size)
    count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
    total = torch.nansum(grouped, dim=1, keepdim=True)
    baseline = (total - grouped) / (count - 1)  # 0/0 = NaN for a lone scorable row, zeroed below
    return torch.nan_to_num((grouped - baseline).reshape(-1), nan=0.0, posinf=0.0, neginf=0.0)


def remax_advantages(rewards: torch.Tensor, greedy_rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """ReMax advantages (arXiv 2310.10505): `A_i = r_i - b_p`, `b_p` the reward of prompt p's greedy completion.

    No whitening, as in the paper. A NaN greedy reward leaves its group without a baseline: advantage 0.

    Args:
        rewards: (N,)
        greedy_rewards: (N // G,)
    Returns:
        (N,)
    """
    grouped = group_view(rewards, group_size)
    if greedy_rewards.shape != (grouped.shape[0],):
        raise ValueError(f"greedy_rewards must have shape ({grouped.shape[0]},), got {tuple(greedy_rewards.shape)}")
    adv = grouped - greedy_rewards.to(grouped.dtype).unsqueeze(1)
    return torch.nan_to_num(adv.reshape(-1), nan=0.0)


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of `x` over the entries where `mask` is 1 (0 when there are none); masked entries may hold NaN/inf.

    Args:
        x: any shape; mask: same shape.
    Returns:
        0-dim tensor.
    """
    valid = mask.bool()
    total = torch.where(valid, x, torch.zeros_like(x)).sum()
    return total / valid.sum().clamp(min=1).to(x.dtype)


def masked_whiten(x: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """`(x - mean) * rsqrt(var + eps)` with the mean and the unbiased variance over the valid entries; 0 where masked.

    Values at masked positions (padding, even NaN/inf) never enter the statistics. With a single valid entry the
    variance is taken as 0 (the entry centres to 0 anyway); with none, the result is all zeros.

    Args:
        x: any shape, e.g. (N, T).
        mask: same shape, 1 for valid entries.
    Returns:
        same shape as `x`.
    """
    valid = mask.bool()
    count = valid.sum().to(x.dtype)
    mean = torch.where(valid, x, torch.zeros_like(x)).sum() / count.clamp(min=1.0)
    centered = torch.where(valid, x - mean, torch.zeros_like(x))
    var = (centered**2).sum() / (count - 1).clamp(min=1.0)  # Bessel
    return centered * torch.rsqrt(var + eps)


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token KL(pi || ref) estimators (Schulman, "Approximating KL divergence"), elementwise, same shape as input.

    k1 = logp - ref; k2 = (logp - ref)^2 / 2; k3 = exp(ref - logp) - (ref - logp) - 1.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kind must be one of {KL_KINDS}, got {kind!r}")
    log_ratio = logp - ref_logp
    if kind == "k1":
        return log_ratio
    if kind == "k2":
        return 0.5 * log_ratio**2
    return torch.exp(-log_ratio) + log_ratio - 1


def _last_valid_index(mask: torch.Tensor) -> torch.Tensor:
    """(N, T) mask -> (N,) index of the last valid token (0 for an empty row)."""
    t = torch.arange(mask.shape[1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), t, torch.zeros_like(t)).max(dim=1).values


def token_rewards_from_outcome(
    rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Token-level rewards: `-kl_coef * kl_t` at every valid token plus the outcome reward at the last valid token.

    Args:
        rewards: (N,) outcome rewards; NaN rows give all-zero token rewards.
        mask: (N, T)
        kl: (N, T) per-token KL estimate, or None.
    Returns:
        (N, T), 0 on masked positions.
    """
    m = mask.to(torch.float32)
    token_rewards = torch.zeros_like(m)
    if kl is not None and kl_coef != 0.0:
        # where, not a product: a NaN/inf at a padding position must not leak into the row
        token_rewards = torch.where(mask.bool(), -kl_coef * kl.to(torch.float32), token_rewards)
    finite = torch.nan_to_num(rewards.to(torch.float32), nan=0.0)
    has_token = m.sum(dim=1) > 0
    rows = torch.arange(m.shape[0], device=m.device)[has_token]
    token_rewards[rows, _last_valid_index(mask)[has_token]] += finite[has_token]
    token_rewards[torch.isnan(rewards)] = 0.0
    return token_rewards * m


def token_rewards_from_steps(step_rewards: torch.Tensor, step_ends: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Dense token rewards from step rewards: each finite step reward at the token where its step ends.

    A step that ends on a masked token (tool output) is credited to the last valid token at or before its end, the
    last action of the policy in that step; a step with no valid token up to its end is dropped. With gamma = 1 the
    returns at valid tokens are those of the reward placed at the step end itself.

    Args:
        step_rewards: (N, S) float, NaN (or +-inf) for missing or unscored steps.
        step_ends: (N, S) long, index in [0, T) of the last completion token of each step; ignored where the reward
            is not finite.
        mask: (N, T)
    Returns:
        (N, T), 0 on masked positions; the sum of the finite step rewards ending at each token.
    """
    n, t_len = mask.shape
    if step_rewards.dim() != 2 or step_rewards.shape[0] != n or step_ends.shape != step_rewards.shape:
        raise ValueError(f"step_rewards and step_ends must both have shape ({n}, S), got {tuple(step_rewards.shape)} "
                         f"and {tuple(step_ends.shape)}")
    finite = torch.isfinite(step_rewards)
    ends = step_ends.to(torch.long)
    if ((ends < 0) | (ends >= t_len))[finite].any():
        raise ValueError(f"step_ends must lie in [0, {t_len}) wherever the step reward is finite")
    positions = torch.arange(t_len, device=mask.device).expand(n, t_len)
    last_valid = torch.where(mask.bool(), positions, torch.full_like(positions, -1)).cummax(dim=1).values
    target = last_valid.gather(1, torch.where(finite, ends, torch.zeros_like(ends)))
    keep = finite & (target >= 0)
    values = torch.where(keep, step_rewards.to(torch.float32), torch.zeros(1, device=step_rewards.device))
    token_rewards = torch.zeros(n, t_len, dtype=torch.float32, device=mask.device)
    return token_rewards.scatter_add_(1, torch.where(keep, target, torch.zeros_like(target)), values)


def _discounted_returns(token_rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{t' >= t, valid} gamma^(#valid steps between) r_t'; masked positions are skipped, not zeroed into."""
    valid_all = mask.bool()
    if gamma == 1.0:  # reverse cumulative sum, no loop
        clean = torch.where(valid_all, token_rewards, torch.zeros_like(token_rewards))
        returns = torch.flip(torch.cumsum(torch.flip(clean, [1]), 1), [1])
        return torch.where(valid_all, returns, torch.zeros_like(returns))
    returns = torch.zeros_like(token_rewards)
    running = torch.zeros_like(token_rewards[:, 0])
    for t in reversed(range(token_rewards.shape[1])):
        valid = mask[:, t].bool()
        running = torch.where(valid, token_rewards[:, t] + gamma * running, running)
        returns[:, t] = torch.where(valid, running, torch.zeros_like(running))
    return returns


def reinforce_pp_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    kl: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    token_rewards: torch.Tensor | None = None,
) -> torch.Tensor:
    """REINFORCE++ advantages (arXiv 2501.03262, Eq. 4-6).

    Token rewards `-kl_coef * kl_t` (+ the outcome reward at the last valid token), returns
    `G_t = sum_{t' >= t} gamma^(t'-t) r_t'`, then `masked_whiten` over all valid tokens of the batch. With gamma = 1
    (the paper's setting) `G_t = r - kl_coef * sum_{t' >= t} kl_t'`, Eq. 4-5. Masked positions inside a row (tool
    output, `tool_mask`) are skipped: they carry no reward and do not count as a discount step.

    Args:
        rewards: (N,) outcome rewards, NaN for unscorable rows (advantage 0, excluded from whitening).
        mask: (N, T)
        kl: (N, T) per-token KL estimate (k1 in the paper), or None.
        token_rewards: (N, T) dense rewards added to those token rewards (process supervision: each step's reward
            at its last token, `token_rewards_from_steps`), or None. Ignored on NaN rows and masked positions.
    Returns:
        (N, T), 0 on masked positions.
    """
    valid = mask.to(torch.float32) * (~torch.isnan(rewards)).to(torch.float32).unsqueeze(1)
    dense = token_rewards_from_outcome(rewards, valid, kl, kl_coef)
    if token_rewards is not None:
        dense = dense + torch.where(valid.bool(), token_rewards.to(torch.float32), torch.zeros_like(dense))
    returns = _discounted_returns(dense, valid, gamma)
    return masked_whiten(returns, valid)


def reinforce_pp_baseline_advantages(rewards: torch.Tensor, mask: torch.Tensor, group_size: int) -> torch.Tensor:
    """REINFORCE++-baseline advantages (arXiv 2501.03262, Eq. 7-8).

    `r_i - mean_group` broadcast to the valid tokens of row i, then `masked_whiten` over all valid tokens of the batch.
    The whitening statistics are token-weighted (a long completion counts once per token), as in the paper's
    `mean/std over A in D_batch` of token-level advantages.

    Args:
        rewards: (N,), NaN for unscorable rows (advantage 0, excluded from the group mean and the whitening).
        mask: (N, T)
    Returns:
        (N, T), 0 on masked positions.
    """
    grouped = group_view(rewards, group_size)
    centered = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)).reshape(-1)
    valid = mask.to(torch.float32) * (~torch.isnan(centered)).to(torch.float32).unsqueeze(1)
    per_token = torch.nan_to_num(centered, nan=0.0).unsqueeze(1) * valid
    return masked_whiten(per_token, valid)


def gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    gamma: float = 1.0,
    lam: float | torch.Tensor = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised Advantage Estimation (arXiv 1506.02438) over valid tokens.

    `delta_t = r_t + gamma * V_next - V_t`, `A_t = delta_t + gamma * lam * A_next`, where "next" is the next *valid*
    token (masked positions neither contribute nor break the recursion) and the value after the last valid token is 0.
    With `lam = 1` and `gamma = 1`, `A_t = sum_{t' >= t} r_t' - V_t` (the Monte-Carlo return minus the value).

    Args:
        token_rewards: (N, T)
        values: (N, T)
        mask: (N, T)
        lam: a float, or a (N,) tensor of per-sequence lambdas (length-adaptive GAE, VAPO).
    Returns:
        advantages (N, T) and returns `advantages + values` (N, T), both 0 on masked positions.
    """
    m = mask.to(torch.float32)
    rewards = token_rewards.to(torch.float32)
    vals = values.detach().to(torch.float32)
    lam_t = torch.as_tensor(lam, dtype=torch.float32, device=rewards.device)
    lam_t = lam_t.expand(rewards.shape[0]) if lam_t.dim() == 0 else lam_t.to(torch.float32)
    if lam_t.shape != (rewards.shape[0],):
        raise ValueError(f"lam must be a float or have shape ({rewards.shape[0]},), got {tuple(lam_t.shape)}")
    advantages = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    next_adv = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        valid = m[:, t].bool()
        delta = rewards[:, t] + gamma * next_value - vals[:, t]
        adv_t = delta + gamma * lam_t * next_adv
        next_adv = torch.where(valid, adv_t, next_adv)
        next_value = torch.where(valid, vals[:, t], next_value)
        advantages[:, t] = torch.where(valid, adv_t, torch.zeros_like(adv_t))
    returns = torch.where(m.bool(), advantages + vals, torch.zeros_like(vals))
    return advantages, returns


def length_adaptive_lambda(lengths: torch.Tensor, alpha: float = 0.05) -> torch.Tensor:
    """VAPO's length-adaptive GAE lambda (arXiv 2504.05118, Eq. 9): `lam = 1 - 1 / (alpha * l)`, clamped to [0, 1].

    Short sequences (`l <= 1 / alpha`, i.e. 20 tokens at alpha = 0.05) get lam = 0: pure one-step TD advantages.
    A length of 0 gives 0 as well (no division by zero).

    Args:
        lengths: (N,) number of valid tokens per completion.
    Returns:
        (N,) float lambdas in [0, 1].
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    scaled = alpha * lengths.to(torch.float32)
    lam = 1.0 - 1.0 / scaled.clamp(min=1e-12)
    return lam.clamp(min=0.0, max=1.0)
