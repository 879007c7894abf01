"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al., "Back to Basics", arXiv 2402.14740)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..advantages import rloo_advantages
from .base import VariantConfig, VariantTrainer, check


@dataclass
class RLOOConfig(VariantConfig):
    r"""
    Configuration for [`RLOOTrainer`]: [`~trl.GRPOConfig`] with RLOO's fields, named and defaulted as in
    `trl.RLOOConfig` so that moving from TRL's RLOO keeps the behaviour.

    Parameters:
        beta (`float`, *optional*, defaults to `0.05`):
            As in `trl.RLOOConfig`: coefficient of the sequence-level KL penalty `beta * sum_t k1_t` subtracted from
            each completion's reward before the leave-one-out baseline (the paper's KL-in-reward). It is *not* a loss
            term here (unlike `GRPOConfig.beta`). `0.0` skips the reference model.
        normalize_advantages (`bool`, *optional*, defaults to `False`):
            Standardise the advantages over the whole generation batch (as `trl.RLOOConfig`).
        reward_clip_range (`tuple[float, float]`, *optional*):
            Clip the total reward to (min, max) before the baseline (as `trl.RLOOConfig`).
    """

    beta: float = field(
        default=0.05,
        metadata={"help": "Coefficient of the summed k1 KL subtracted from the reward (trl.RLOOConfig semantics)."},
    )
    normalize_advantages: bool = field(
        default=False, metadata={"help": "Standardise the advantages over the generation batch."}
    )
    reward_clip_range: tuple[float, float] | None = field(
        default=None, metadata={"help": "Clip the total reward to (min, max) before the baseline."}
    )

    def __post_init__(self):
        super().__post_init__()
        # beta is the KL-in-reward coefficient here (trl.RLOOConfig); the loss gets no KL term
        self.kl_in_reward_coef = self.beta
        self.kl_in_reward_estimator = "k1"
        if self.reward_clip_range is not None:
            check(len(self.reward_clip_range) == 2 and self.reward_clip_range[0] <= self.reward_clip_range[1],
                  "reward_clip_range", "(min, max) with min <= max", self.reward_clip_range)


class RLOOTrainer(VariantTrainer):
    """RLOO (arXiv 2402.14740) on top of TRL's `GRPOTrainer`: every completion's baseline is the mean reward of the
    other G - 1 completions of its prompt; the KL to the reference (summed k1, as in the paper and `trl.RLOOTrainer`)
    is subtracted from the reward first. The policy loss is `GRPOTrainer`'s (set by `loss_type`)."""

    _tag_names = ["trl", "trl-ppo-variants", "rloo"]

    def __init__(self, model, reward_funcs, args: RLOOConfig | None = None, **kwargs):
        if args is None:
            args = RLOOConfig(output_dir="rloo-output")
        if not isinstance(args, RLOOConfig):
            raise TypeError(f"args: expected an RLOOConfig, got {type(args).__name__}")
        beta = args.beta
        args.beta = 0.0  # the KL goes into the reward (kl_in_reward_coef), not the loss
        try:
            super().__init__(model, reward_funcs, args=args, **kwargs)
        finally:
            args.beta = beta

    def compute_advantages(self, rewards, batch, group_size):
        if self.args.reward_clip_range is not None:  # clip, then penalise, as trl.RLOOTrainer does
            lo, hi = self.args.reward_clip_range
            rewards = rewards.clamp(min=lo, max=hi)
        if batch is not None and "kl_in_reward" in batch:
            rewards = rewards - self.kl_in_reward_coef * batch["kl_in_reward"].sum(dim=1)
        advantages = rloo_advantages(rewards, group_size)
        if self.args.normalize_advantages:
            scorable = ~torch.isnan(rewards)
            a = advantages[scorable]
            if a.numel() > 1:
                advantages = torch.where(scorable, (advantages - a.mean()) / (a.std() + 1e-4), advantages)
        return advantages
