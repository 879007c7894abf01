"""Loss terms: pure torch functions on (B, T) per-token tensors. Shapes in the docstrings."""

from __future__ import annotations

import torch

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo", "cispo", "vespo", "sapo", "luspo")


def aggregate_token_loss(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    loss_type: str,
    *,
    num_items_in_batch: torch.Tensor | float | None = None,
    num_processes: int = 1,
    grad_accum: int = 1,
    steps_per_generation: int = 1,
    max_completion_length: int | None = None,
) -> torch.Tensor:
    """Reduce a (B, T) per-token loss to a scalar the way TRL's `GRPOTrainer` reduces its policy loss for `loss_type`.

    - "grpo"/"sapo": mean over sequences of the per-sequence token mean, divided by `grad_accum`;
    - "luspo": mean over sequences of the per-sequence token *sum* (length-weighted), divided by `grad_accum`;
    - "bnpo": token mean over the local batch, divided by `grad_accum`;
    - "dr_grpo": sum / (B * max_completion_length), divided by `grad_accum`;
    - "dapo"/"cispo"/"vespo" (token-level, DAPO arXiv 2503.14476 Eq. 12): sum over tokens divided by the number of loss
      tokens of the whole generation batch, rescaled to one accumulation window
      (`num_items_in_batch / num_processes * grad_accum / steps_per_generation`), so that the sum over ranks and
      micro-batches is the global token mean. In eval, pass `grad_accum=1, steps_per_generation=1` (TRL does not
      rescale there).

    Using the same reduction for an added term (a KL or value loss) keeps its weight relative to the policy loss
    independent of batch layout.
    """
    m = mask.to(per_token.dtype)
    if loss_type in ("grpo", "sapo"):
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / grad_accum
    if loss_type == "luspo":
        return (per_token * m).sum(-1).mean() / grad_accum
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1.0) / grad_accum
    if loss_type == "dr_grpo":
        if not max_completion_length:
            raise ValueError("loss_type 'dr_grpo' needs max_completion_length")
        return (per_token * m).sum() / (per_token.size(0) * max_completion_length) / grad_accum
    if loss_type in ("dapo", "cispo", "vespo"):
        if num_items_in_batch is None:
            raise ValueError(f"loss_type {loss_type!r} needs num_items_in_batch")
        total = torch.as_tensor(num_items_in_batch, dtype=per_token.dtype, device=per_token.device).clamp(min=1.0)
        normalizer = total / num_processes * grad_accum / steps_per_generation
        return (per_token * m).sum() / normalizer
    raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {loss_type!r}")


# --------------------------------------------------------------------------------------------- PPO / VAPO terms
def ppo_clip_policy_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor,
    advantages: torch.Tensor,
    epsilon_low: float,
    epsilon_high: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate per token (arXiv 1707.06347, Eq. 7) with Clip-Higher and dual-clip.

    `r = exp(logps - old_logps)`; `loss = max(-A r, -A clip(r, 1 - epsilon_low, 1 + epsilon_high))` (Clip-Higher: an
    upper bound of its own, DAPO arXiv 2503.14476 Eq. 10). Dual-clip (Ye et al., arXiv 1912.09729, Eq. 5): for A < 0
    the loss is further capped at `-A * clip_ratio_c`, so a token whose ratio has exploded (r > c) cannot push an
    unbounded update; its gradient is zero.

    Args:
        logps: (B, T) log-probs of the current policy (with grad).
        old_logps: (B, T) log-probs of the sampling policy.
        advantages: (B, T) or (B, 1).
        epsilon_high: None means `epsilon_low`.
        clip_ratio_c: dual-clip bound (> 1), None disables it.
    Returns:
        per-token loss (B, T), and bool (B, T) masks: "low" (A < 0 and r < 1 - eps_low), "high" (A > 0 and
        r > 1 + eps_high), "dual" (A < 0 and r > c; all False without dual-clip).
    """
    if epsilon_high is None:
        epsilon_high = epsilon_low
    ratio = torch.exp(logps - old_logps)
    advantages = advantages.to(ratio.dtype)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - epsilon_low, 1.0 + epsilon_high)
    loss = torch.maximum(unclipped, clipped)
    negative = advantages < 0
    masks = {
        "low": negative & (ratio < 1.0 - epsilon_low),
        "high": (advantages > 0) & (ratio > 1.0 + epsilon_high),
    }
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1, got {clip_ratio_c}")
        cap = -advantages * clip_ratio_c
        dual = negative & (loss > cap)
        loss = torch.where(dual, torch.minimum(loss, cap), loss)
        masks["dual"] = dual
    else:
        masks["dual"] = torch.zeros_like(negative)
    return loss, masks


def clipped_value_loss(
    values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, clip_range: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token: `0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)`.

    (The clipping of OpenAI baselines' PPO2 and of TRL's former PPOTrainer.) `clip_range=None` gives the plain
    `0.5 * (V - R)^2`.

    Args:
        values: (B, T) current critic values (with grad).
        old_values: (B, T) critic values at rollout time.
        returns: (B, T) targets.
    Returns:
        per-token loss (B, T), and a bool (B, T) mask of the tokens where the clipped term is the larger one (its
        gradient is then zero: the "value clip fraction").
    """
    values = values.float()
    returns = returns.float()
    unclipped = (values - returns) ** 2
    if clip_range is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    old_values = old_values.float()
    clipped_values = old_values + torch.clamp(values - old_values, -clip_range, clip_range)
    clipped = (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped


def positive_example_nll(logps: torch.Tensor, mask: torch.Tensor, positive: torch.Tensor) -> torch.Tensor:
    """Per-token NLL of VAPO's positive-example LM loss (arXiv 2504.05118, Eq. 11), and its token mask.

    The paper's term is `mu * L_NLL` with `L_NLL = -1 / sum_{o_i in T} |o_i| * sum_{o_i in T} sum_t log pi(a_t | s_t)`,
    T the completions judged correct. This returns the numerator's terms; reduce them with `aggregate_token_loss(...,
    "dapo", num_items_in_batch=<number of tokens of correct completions>)` (or a sum divided by the mask's sum) to get
    that token mean. Rows that are not positive contribute nothing, so the term is 0 when no completion is correct.

    Args:
        logps: (B, T) log-probs of the current policy (with grad).
        mask: (B, T) valid completion tokens.
        positive: (B,) bool or 0/1: completions judged correct.
    Returns:
        per-token NLL (B, T) (0 outside the positive mask) and the positive-token mask (B, T) float.
    """
    pos_mask = mask.to(logps.dtype) * positive.to(logps.dtype).unsqueeze(1)
    return -logps * pos_mask, pos_mask
