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

    - "grpo"/"sapo"/"luspo": mean over sequences of the per-sequence token mean, divided by `grad_accum`;
    - "bnpo": token mean over the local batch, divided by `grad_accum`;
    - "dr_grpo": sum / (B * max_completion_length), divided by `grad_accum`;
    - "dapo"/"cispo"/"vespo" (token-level, DAPO arXiv 2503.14476 Eq. 12): sum over tokens divided by the number of loss
      tokens of the whole generation batch, rescaled to one accumulation window
      (`num_items_in_batch / num_processes * grad_accum / steps_per_generation`), so that the sum over ranks and
      micro-batches is the global token mean.

    Using the same reduction for an added term (a KL or value loss) keeps its weight relative to the policy loss
    independent of batch layout.
    """
    m = mask.to(per_token.dtype)
    if loss_type in ("grpo", "sapo", "luspo"):
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean() / grad_accum
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
