"""GRPO with process supervision (Shao et al., DeepSeekMath, arXiv 2402.03300, Sec. 4.1.3).

A process reward (a step reward function or a process reward model, see `process.py`) scores every reasoning step of
the G outputs of a prompt; each step reward is normalised with the mean and the sample standard deviation of all the
step rewards of the group, and a token's advantage is the sum of the normalised rewards of the steps of its output
that end at or after it (`advantages.grpo_process_advantages`). The loss is GRPO's (TRL's), with (N, T) advantages.

Outcome rewards (the ordinary `reward_funcs`) may be combined: their GRPO advantage (`grpo_advantages`, with
`scale_rewards`) is added to every token of the output. The paper trains with the process reward alone; normalising
the two signals separately and adding the advantages is what PRIME (arXiv 2502.01456, Sec. 3.3) does to combine
process and outcome rewards, and it keeps either signal from drowning the other by its scale or its number of steps
(adding the outcome to the last step's reward instead would make it one step among many in the normalisation). With
step rewards only this is the paper's method; with outcome rewards only it is GRPO, advantage for advantage.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .. import rollout
from ..advantages import grpo_process_advantages
from ..errors import check
from ..process import StepRewardFields, StepRewardsMixin
from ..screening import PromptSelectionFields, PromptSelectionMixin
from .base import VariantConfig, VariantTrainer


@dataclass
class ProcessGRPOConfig(StepRewardFields, PromptSelectionFields, VariantConfig):
    r"""
    Configuration for [`ProcessGRPOTrainer`]: [`~trl.GRPOConfig`] with the step-reward fields of
    [`~trl_ppo_variants.process.StepRewardFields`] (`step_separator`, `process_reward_model_path`,
    `process_reward_model_style`, `process_reward_model_step_tag`; see there).

    Step reward functions are passed to the trainer (`step_reward_funcs=[...]`), a process reward model through
    `process_reward_model_path`; `reward_funcs` are outcome rewards, whose GRPO advantage is added to the process
    advantage. `reward_weights` has one weight per column: `reward_funcs`, then `step_reward_funcs`, then the process
    reward model. `scale_rewards` and `multi_objective_aggregation` (`"normalize_then_sum"`, GDPO, is accepted) apply
    to the outcome advantage only: the process advantage is always normalised by its group's standard deviation, as
    in the paper. The KL is GRPO's loss term (`beta`); `kl_in_reward_coef` must stay 0. `prompt_selection` (fields
    of [`~trl_ppo_variants.screening.PromptSelectionFields`]) filters on the outcome rewards plus each step source's
    summed step rewards (`filter_metric="reward"`): a group whose completions tie on all of them is treated as
    uninformative (its step rewards may still differ step by step; name a reward function in `filter_metric` to
    filter on it alone).
    """

    multi_objective_aggregations: ClassVar[tuple[str, ...]] = ("sum_then_normalize", "normalize_then_sum")

    def __post_init__(self):
        check(self.kl_in_reward_coef == 0.0, "kl_in_reward_coef",
              "0.0 (GRPO with process supervision puts the KL in the loss: use `beta`)", self.kl_in_reward_coef)
        super().__post_init__()


class ProcessGRPOTrainer(StepRewardsMixin, PromptSelectionMixin, VariantTrainer):
    """GRPO with process supervision (arXiv 2402.03300, Sec. 4.1.3) on top of TRL's `GRPOTrainer`.

    `ProcessGRPOTrainer(model, reward_funcs=[outcome...], step_reward_funcs=[steps...], args=ProcessGRPOConfig(...))`.
    Either may be empty (not both). Logged besides GRPO's metrics: `process/steps` (scored steps per completion) and
    `process/step_reward` (mean step reward).
    """

    _tag_names = ["trl", "trl-ppo-variants", "process_grpo"]
    config_class = ProcessGRPOConfig
    needs_global_batch = True

    def __init__(self, model, reward_funcs=None, args: ProcessGRPOConfig | None = None, step_reward_funcs=None,
                 **kwargs):
        args = self.resolve_args(args)
        super().__init__(model, reward_funcs, args=args, step_reward_funcs=step_reward_funcs, **kwargs)

    def filter_values(self, rewards_per_func):
        if self.args.filter_metric != "reward":
            return super().filter_values(rewards_per_func)
        return VariantTrainer.total_rewards(self, rewards_per_func)  # outcome and step columns alike

    def compute_advantages(self, rewards, batch, group_size):
        mask = rollout.loss_mask(batch).to(torch.float32)
        advantages = torch.zeros_like(mask)
        if self.step_batch is not None:
            step_rewards, step_ends = self.step_batch
            advantages = grpo_process_advantages(step_rewards, step_ends, mask, group_size)
        if self.has_outcome_rewards:
            per_func = self.advantage_rewards_per_func
            if per_func is not None and self._step_columns:  # a step source's column (its summed steps) is no outcome
                per_func = per_func.clone()
                per_func[:, self._step_columns] = float("nan")
                self.advantage_rewards_per_func = per_func
            outcome = self.grpo_group_advantages(rewards, group_size)
            advantages = advantages + outcome.unsqueeze(1) * mask
        return advantages


__all__ = ["ProcessGRPOConfig", "ProcessGRPOTrainer"]
