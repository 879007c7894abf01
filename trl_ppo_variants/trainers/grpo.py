"""GRPO (Shao et al., DeepSeekMath, arXiv 2402.03300) as this package's trainer: TRL's `GRPOTrainer`, with the
package's shared fields, chiefly `prompt_selection` (SPEED screening, GRESO skipping, DAPO's dynamic sampling; see
`trl_ppo_variants.screening`), so that a TRL user turns screening on with one field without changing algorithm."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..errors import check
from ..screening import PromptSelectionFields, PromptSelectionMixin
from .base import AGGREGATIONS, VariantConfig, VariantTrainer


@dataclass
class GRPOConfig(PromptSelectionFields, VariantConfig):
    r"""
    Configuration for [`GRPOTrainer`]: [`~trl.GRPOConfig`] with the fields of
    [`~trl_ppo_variants.screening.PromptSelectionFields`] (`prompt_selection="speed"`, `"greso"`, `"speed+greso"` or
    `"dynamic_sampling"` turn the selection on) and the package's shared ones ([`~trl_ppo_variants.VariantConfig`]).
    With every field of this package at its default it trains exactly as `trl.GRPOTrainer` (tested: equal weights).

    Parameters:
        token_level_normalizer (`str`, *optional*, defaults to `"generation_batch"`):
            As in [`~trl_ppo_variants.VariantConfig`], but TRL's normaliser by default, so that layouts with
            `steps_per_generation != gradient_accumulation_steps` train as `trl.GRPOTrainer` does.
    """

    token_level_normalizer: str = field(
        default="generation_batch",
        metadata={"help": "Token-level losses: TRL's normaliser ('generation_batch', default) or each optimizer "
                          "step's own tokens ('optimizer_step', DAPO Eq. 12)."},
    )

    multi_objective_aggregations: ClassVar[tuple[str, ...]] = AGGREGATIONS

    def __post_init__(self):
        check(self.kl_in_reward_coef == 0, "kl_in_reward_coef",
              "0 (GRPO's KL is the loss term weighted by `beta`)", self.kl_in_reward_coef)
        super().__post_init__()


class GRPOTrainer(PromptSelectionMixin, VariantTrainer):
    """GRPO (arXiv 2402.03300) on top of TRL's `GRPOTrainer`: TRL's advantage (`scale_rewards`,
    `multi_objective_aggregation`), computed again on the kept groups when prompts are selected. Without selection
    the advantages are TRL's own, untouched."""

    _tag_names = ["trl", "trl-ppo-variants", "grpo"]
    config_class = GRPOConfig

    def __init__(self, model, reward_funcs=None, args: GRPOConfig | None = None, **kwargs):
        args = self.resolve_args(args)
        super().__init__(model, reward_funcs, args=args, **kwargs)

    def compute_advantages(self, rewards, batch, group_size):
        return self.grpo_group_advantages(rewards, group_size)

    def _replace_advantages(self, output, inputs):
        return output  # TRL's advantages already are GRPO's: nothing to recompute


__all__ = ["GRPOConfig", "GRPOTrainer"]
