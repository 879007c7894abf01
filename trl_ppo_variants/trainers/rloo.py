"""RLOO: REINFORCE Leave-One-Out (Ahmadian et al., "Back to Basics", arXiv 2402.14740)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..advantages import rloo_advantages
from ..errors import check
from ..screening import PromptSelectionFields, PromptSelectionMixin
from .base import VariantConfig, VariantTrainer, is_coefficient


@dataclass
class RLOOConfig(PromptSelectionFields, VariantConfig):
    r"""
    Configuration for [`RLOOTrainer`]: [`~trl.GRPOConfig`] with RLOO's fields, named and defaulted as in
    `trl.RLOOConfig` so that moving from TRL's RLOO keeps the behaviour.

    The policy loss is `GRPOTrainer`'s. Its defaults here, `loss_type="luspo"` with
    `importance_sampling_level="sequence"`, make the on-policy gradient exactly `trl.RLOOTrainer`'s (and the paper's
    estimator `-1/N sum_i A_i grad log pi(y_i|x)`, summed over the tokens of each completion, not averaged): TRL's RLOO
    loss is `-mean_i min(R_i A_i, clip(R_i) A_i)` with the sequence ratio `R_i = pi(y_i)/pi_old(y_i)`; ours weights each
    sequence by its length and uses the length-normalised (geometric-mean) ratio, which has the same gradient at
    ratio 1. Off-policy (`num_iterations > 1`) the clipping differs: TRL clips the product of token ratios, which
    clips almost every long completion. The loss *values* differ on-policy: TRL's is `-mean_i A_i`, identically 0
    because leave-one-out advantages sum to 0 per group; ours is `-mean_i |y_i| A_i`. Any other `loss_type` works
    (e.g. "dapo": the same gradient direction scaled by `N / num_tokens`).
    `scale_rewards` and `multi_objective_aggregation` (GRPO's) are not used: RLOO's scaling is `normalize_advantages`.
    `prompt_selection` (SPEED screening, GRESO skipping, dynamic sampling; fields of
    [`~trl_ppo_variants.screening.PromptSelectionFields`]) filters on the task reward, before the KL penalty.

    Parameters:
        loss_type (`str`, *optional*, defaults to `"luspo"`):
            As in [`~trl.GRPOConfig`]; see above for why the default matches `trl.RLOOTrainer`.
        importance_sampling_level (`str`, *optional*, defaults to `"sequence"`):
            As in [`~trl.GRPOConfig`]: one ratio per completion, as `trl.RLOOTrainer`.
        beta (`float`, *optional*, defaults to `0.05`):
            As in `trl.RLOOConfig`: coefficient of the sequence-level KL penalty `beta * sum_t k1_t` subtracted from
            each completion's reward before the leave-one-out baseline (the paper's KL-in-reward). It is *not* a loss
            term here (unlike `GRPOConfig.beta`). `0.0` skips the reference model. `kl_in_reward_coef` mirrors it
            (leave it unset); `kl_in_reward_estimator` (default `"k1"`, TRL's) selects the per-token estimator.
        normalize_advantages (`bool`, *optional*, defaults to `False`):
            Standardise the advantages over the whole generation batch (as `trl.RLOOConfig`).
        reward_clip_range (`tuple[float, float]`, *optional*):
            Clip the total reward to (min, max) before the baseline (as `trl.RLOOConfig`).
    """

    loss_type: str = field(
        default="luspo",
        metadata={"help": "GRPOTrainer's loss type; 'luspo' gives trl.RLOOTrainer's on-policy gradient."},
    )
    importance_sampling_level: str = field(
        default="sequence", metadata={"help": "'token' or 'sequence' (one ratio per completion, as trl.RLOOTrainer)."}
    )
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
        # beta is the KL-in-reward coefficient here (trl.RLOOConfig); the loss gets no KL term
        check(is_coefficient(self.beta), "beta", "a number >= 0", self.beta)
        check(self.kl_in_reward_coef in (0.0, self.beta), "kl_in_reward_coef",
              f"unset (RLOO's KL-in-reward coefficient is `beta`, here {self.beta}, as in trl.RLOOConfig)",
              self.kl_in_reward_coef)
        self.kl_in_reward_coef = self.beta
        super().__post_init__()
        if self.reward_clip_range is not None:
            check(len(self.reward_clip_range) == 2 and self.reward_clip_range[0] <= self.reward_clip_range[1],
                  "reward_clip_range", "(min, max) with min <= max", self.reward_clip_range)


class RLOOTrainer(PromptSelectionMixin, VariantTrainer):
    """RLOO (arXiv 2402.14740) on top of TRL's `GRPOTrainer`: every completion's baseline is the mean reward of the
    other G - 1 completions of its prompt; the KL to the reference (summed k1, as in the paper and `trl.RLOOTrainer`)
    is subtracted from the reward first. The policy loss is `GRPOTrainer`'s (set by `loss_type`)."""

    _tag_names = ["trl", "trl-ppo-variants", "rloo"]
    config_class = RLOOConfig

    def __init__(self, model, reward_funcs=None, args: RLOOConfig | None = None, **kwargs):
        super().__init__(model, reward_funcs, args=self.resolve_args(args), **kwargs)

    def kl_coefficients(self, args) -> tuple[float, float]:
        """`beta` is the KL-in-reward coefficient (`trl.RLOOConfig`'s meaning): no KL term in the loss."""
        args.kl_in_reward_coef = args.beta  # follows `beta` even if it was changed after the config was built
        return 0.0, float(args.beta)

    def compute_advantages(self, rewards, batch, group_size):
        if self.args.reward_clip_range is not None:  # clip, then penalise, as trl.RLOOTrainer does
            lo, hi = self.args.reward_clip_range
            rewards = rewards.clamp(min=lo, max=hi)
        if batch is not None and "kl_in_reward" in batch:
            rewards = rewards - self.kl_in_reward_coef * batch["kl_in_reward"].sum(dim=1)
        if group_size == 1:
            # evaluation with `num_generations_eval=1` (training needs >= 2): a completion without siblings has no
            # leave-one-out baseline, so no advantage, as a lone scorable row of a group (GRPO's is 0 there too)
            return torch.zeros_like(rewards)
        advantages = rloo_advantages(rewards, group_size)
        if self.args.normalize_advantages:
            # statistics over the rows that have a leave-one-out baseline, as trl.RLOOTrainer (its other rows are NaN)
            grouped = rewards.view(-1, group_size)
            count = (~torch.isnan(grouped)).sum(dim=1, keepdim=True).expand_as(grouped).reshape(-1)
            has_baseline = ~torch.isnan(rewards) & (count >= 2)
            a = advantages[has_baseline]
            if a.numel() > 1:
                normalized = (advantages - a.mean()) / (a.std() + 1e-4)
                advantages = torch.where(has_baseline, normalized, torch.zeros_like(advantages))
        return advantages
