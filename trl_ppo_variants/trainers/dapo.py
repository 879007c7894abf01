"""DAPO: Decoupled Clip and Dynamic sAmpling Policy Optimization (Yu et al., arXiv 2503.14476)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from trl.rewards import get_soft_overlong_punishment

from ..errors import check
from ..screening import PromptSelectionFields, PromptSelectionMixin
# the dynamic-sampling pieces live in the shared selection module; re-exported here for existing imports
from ..selection import (  # noqa: F401
    GroupAccumulator,
    RefillSampler,
    binomial_at_least,
    keep_rate_estimate,
    prompts_to_generate,
    update_keep_rate,
)
from .base import VariantConfig, VariantTrainer

OVERLONG_REWARD_NAME = "soft_overlong_punishment_reward"  # the __name__ of TRL's soft overlong punishment


def default_overlong_cache_length(max_completion_length: int) -> int:
    """`L_cache` of Eq. 13 when none is set: 20% of `L_max` (the paper's 4096 of 20480), in whole tokens rounded down.
    Below 5 tokens that is 0, no soft zone: nothing is penalised, since a completion never exceeds `L_max`
    (`overlong_cache_tokens` refuses it)."""
    return max_completion_length // 5


def overlong_cache_tokens(max_completion_length: int, overlong_cache_length: int | None, user: str,
                          cache_field: bool = True) -> int:
    """`L_cache` of an overlong penalty used by `user` (DAPO's shaping, the `overlong` reward, ...): the configured
    `overlong_cache_length`, else `default_overlong_cache_length`. A cache of 0 tokens penalises nothing (no
    completion exceeds `max_completion_length`): an error, not a no-op, raised as the one-line config error of the
    field to change (`cache_field`: whether the run's config has `overlong_cache_length` to offer instead)."""
    if overlong_cache_length is not None:
        check(overlong_cache_length >= 1, "overlong_cache_length",
              f"an integer >= 1 with {user} (a cache of 0 tokens penalises nothing: an error, not a no-op)",
              overlong_cache_length)
        return overlong_cache_length
    cache = default_overlong_cache_length(max_completion_length)
    check(cache >= 1, "max_completion_length",
          f"an integer >= 5 with {user} (its default cache, 20% rounded down, is 0 tokens, which penalises nothing)"
          + (" or overlong_cache_length >= 1" if cache_field else ""), max_completion_length)
    return cache


def is_overlong_penalty(func) -> bool:
    """Whether a reward function is an overlong penalty: the package's `overlong` reward (by its type, whatever its
    name) or TRL's soft overlong punishment (by the function `get_soft_overlong_punishment` returns, or its name)."""
    from ..rewards import overlong_reward

    if isinstance(func, overlong_reward):
        return True
    qualname = getattr(func, "__qualname__", "") or ""
    return (getattr(func, "__name__", None) == OVERLONG_REWARD_NAME
            or qualname.startswith("get_soft_overlong_punishment.<locals>."))


@dataclass
class DAPOConfig(PromptSelectionFields, VariantConfig):
    r"""
    Configuration for [`DAPOTrainer`]: [`~trl.GRPOConfig`] with DAPO's defaults (arXiv 2503.14476) and its two
    data-side techniques, dynamic sampling and overlong reward shaping.

    Parameters:
        epsilon (`float`, *optional*, defaults to `0.2`):
            Lower clip range (Clip-Higher, Eq. 10: `epsilon_low`).
        epsilon_high (`float`, *optional*, defaults to `0.28`):
            Upper clip range (Clip-Higher: decoupled from `epsilon`).
        beta (`float`, *optional*, defaults to `0.0`):
            KL loss coefficient; DAPO removes the KL term.
        loss_type (`str`, *optional*, defaults to `"dapo"`):
            Token-level policy-gradient loss (Eq. 12): sum over every token of the batch / number of tokens. With
            several optimizer steps per rollout (`steps_per_generation > gradient_accumulation_steps`, the paper's
            16 updates), each step is divided by its own tokens (`token_level_normalizer="optimizer_step"`).
        multi_objective_aggregation (`str`, *optional*, defaults to `"sum_then_normalize"`):
            As in [`~trl.GRPOConfig`]; `"normalize_then_sum"` (GDPO) normalises each reward function within its group
            (the overlong shaping term included), sums them with `reward_weights` and normalises over the batch.
        dynamic_sampling (`bool`, *optional*, defaults to `True`):
            Drop the groups whose `filter_metric` has no spread (all completions equally right or wrong) and refill
            the batch with groups of fresh prompts until it holds as many groups as a generation batch
            (`generation_batch_size // num_generations`). Training only; evaluation is plain GRPO. It is
            `prompt_selection="dynamic_sampling"`; `prompt_selection="speed"`, `"greso"` or `"speed+greso"` screen or
            skip prompts before generating their whole groups (`trl_ppo_variants.screening`) and need it on. Its
            fields (`filter_metric` (`"reward"`: the task reward *without* the overlong shaping, as the paper filters
            on accuracy), `filter_std_eps`, `max_generation_rounds`, `refill_num_prompts`, `keep_rate_init`,
            `keep_rate_smoothing`, `shortfall_probability`, `max_oversample_factor`) are those of
            [`~trl_ppo_variants.screening.PromptSelectionFields`], with the same defaults.
        overlong_penalty (`bool`, *optional*, defaults to `True`):
            Add the soft overlong punishment (Eq. 13, `trl.rewards.get_soft_overlong_punishment` with
            `L_max = max_completion_length`) to each completion's reward (weight 1) for its advantage. It is DAPO's
            shaping, not one of the user's reward functions: `reward_funcs`, `reward_func_names`,
            `reward_processing_classes`, `reward_weights` and the logged `reward` stay the user's (as with
            `trl.GRPOTrainer`); the shaping is logged as `dapo/overlong_penalty` (its mean over the generated
            completions) and `dapo/frac_overlong_penalized` (the share it lowers). An overlong penalty among
            `reward_funcs` (the package's `overlong`, TRL's `get_soft_overlong_punishment`) would apply it twice: it
            is refused while this is on, and is not a task reward for the filter when this is off.
        overlong_cache_length (`int`, *optional*):
            `L_cache` of Eq. 13, in tokens, in `[1, max_completion_length)`. `None`: 20% of `max_completion_length`
            (rounded down), the paper's 4096 / 20480. A cache of 0 tokens (also the default below 5 tokens of
            `max_completion_length`) penalises nothing: refused while `overlong_penalty` is on.
    """

    epsilon: float = field(default=0.2, metadata={"help": "Lower clip range (Clip-Higher epsilon_low)."})
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Upper clip range (Clip-Higher)."})
    beta: float = field(default=0.0, metadata={"help": "KL loss coefficient; DAPO uses none."})
    loss_type: str = field(default="dapo", metadata={"help": "Token-level loss: sum over tokens / number of tokens."})
    dynamic_sampling: bool = field(
        default=True, metadata={"help": "Drop groups without reward spread and refill the batch with fresh prompts."}
    )
    overlong_penalty: bool = field(
        default=True, metadata={"help": "Add the soft overlong punishment (DAPO Eq. 13) to the reward."}
    )
    overlong_cache_length: int | None = field(
        default=None, metadata={"help": "L_cache in tokens; None = 20% of max_completion_length."}
    )

    multi_objective_aggregations = ("sum_then_normalize", "normalize_then_sum")

    def __post_init__(self):
        super().__post_init__()
        check(self.dynamic_sampling or self.prompt_selection == "none", "dynamic_sampling",
              f"True with prompt_selection={self.prompt_selection!r} (screening and skipping keep the groups with a "
              "spread and refill: they are dynamic sampling)", self.dynamic_sampling)
        check(self.kl_in_reward_coef == 0, "kl_in_reward_coef",
              "0 (DAPO has no KL in the reward; use beta for a KL loss term)", self.kl_in_reward_coef)
        if self.overlong_penalty:
            check(isinstance(self.max_completion_length, int) and self.max_completion_length >= 1,
                  "max_completion_length", "an integer >= 1 when overlong_penalty is on", self.max_completion_length)
            if self.overlong_cache_length is not None:
                check(isinstance(self.overlong_cache_length, int)
                      and 0 <= self.overlong_cache_length < self.max_completion_length,
                      "overlong_cache_length", f"None or an integer in [0, {self.max_completion_length})",
                      self.overlong_cache_length)
            overlong_cache_tokens(self.max_completion_length, self.overlong_cache_length, "overlong_penalty=True")

    def selection_mode(self) -> str:
        if self.prompt_selection == "none" and self.dynamic_sampling:
            return "dynamic_sampling"
        return self.prompt_selection

    @property
    def effective_overlong_cache_length(self) -> int:
        """`L_cache` in tokens: the configured one, else 20% of `max_completion_length` (paper: 4096 / 20480)."""
        if self.overlong_cache_length is not None:
            return self.overlong_cache_length
        return default_overlong_cache_length(self.max_completion_length)


# ----------------------------------------------------------------------------------------------- trainer
class DAPOTrainer(PromptSelectionMixin, VariantTrainer):
    """DAPO (Yu et al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476) on top of
    TRL's `GRPOTrainer`: GRPO advantages without KL, with

    1. Clip-Higher (`epsilon=0.2`, `epsilon_high=0.28`) and the token-level loss (`loss_type="dapo"`): TRL's;
    2. overlong reward shaping (Eq. 13): `trl.rewards.get_soft_overlong_punishment(max_completion_length,
       L_cache)` added to each completion's reward for its advantage (weight 1, also when `reward_weights` is given),
       outside TRL's reward list: it is an extra column of the reward table the advantages are computed from, not a
       reward function, so every TRL reward API behaves as with
       `trl.GRPOTrainer`, and the dynamic-sampling filter never sees it;
    3. dynamic sampling (Eq. 11): after scoring, the groups whose `filter_metric` has std <= `filter_std_eps` are
       dropped and fresh prompts are generated and scored until the batch holds
       `generation_batch_size // num_generations` groups; the surplus of the last round is trimmed. Advantages are
       GRPO's over the kept groups (`scale_rewards` as configured).

    Dynamic sampling is the loop every group estimator of the package shares (`trl_ppo_variants.screening`:
    `PromptSelection`), with `prompt_selection="dynamic_sampling"`; `prompt_selection="speed"` (screen new prompts
    with a few completions first), `"greso"` (skip prompts whose recent groups had no spread) or `"speed+greso"` run
    through the same loop. What it does for DAPO:

    **Refills**: a seeded `selection.RefillSampler` over the train data set, or the next records of an
    `IterableDataset` stream, whose position is saved in checkpoints and restored on resume.

    **Round sizing** (not in the paper, whose refills are whole generation batches; verl over-samples with a fixed
    `gen_batch_size`): a keep-rate estimate (an exponentially weighted ratio of groups with a spread to groups
    generated, updated after every round, identical on every process, saved in checkpoints) sizes each round with
    `selection.prompts_to_generate`: the first round is the dataloader's batch plus enough refill prompts, in the
    same generation call, that it suffices with probability `1 - shortfall_probability`; a refill is sized the same
    way to the groups still missing, not to a whole generation batch. On the toy benchmark (`bench/suite.py`, keep
    rate 0.63) it took the rounds per step from 1.87 to 1.23 for 1.97 generated tokens per trained token instead of
    1.81: at keep rate p no sizing generates fewer than 1/p prompts per trained prompt, and fewer rounds cost some
    trimmed surplus (`shortfall_probability` trades one for the other). The learning per step is unchanged.

    Every process decides from the gathered rewards (identical everywhere), so all agree on the number of rounds;
    the kept groups are then split evenly over the processes (a group may span two of them, as in TRL).
    TRL then shuffles and splits the batch into `steps_per_generation` slices as usual, and reuses it for
    `num_iterations` passes.

    **Exhaustion** (`max_generation_rounds` reached without a full batch): the step trains on the kept groups,
    rounded down to a multiple of `selection.group_multiple(G, num_processes, steps_per_generation)` so that every
    process and every slice gets the same number of rows. If that leaves none, the kept groups are padded with
    dropped (no-spread) groups up to that multiple, trained with advantage 0 (a no-signal step, exactly what GRPO
    does on an all-equal batch). A warning with the numbers is issued once, and `dapo/exhausted` logs 1.

    Metrics (per generation step): `dapo/rounds`, `dapo/groups_generated`, `dapo/groups_kept` (with spread, trained),
    `dapo/frac_dropped_all_correct` and `dapo/frac_dropped_all_wrong` (of the generated groups; a no-spread group
    counts as correct when its common value is > 0), `dapo/gen_tokens_per_trained_token` (completion tokens generated
    in all rounds / loss tokens of the kept groups), `dapo/exhausted`, `dapo/padded_groups`,
    `dapo/keep_rate_estimate` (the estimate that sized the step's first round), `dapo/first_round_prompts`,
    `dapo/refill_prompts` (all refills of the step), `dapo/prompts_per_round`, `dapo/trimmed_groups` (groups
    with a spread generated but not trained: the surplus), and `dapo/prompts_screened`, `dapo/prompts_accepted`,
    `dapo/prompts_skipped` (GRESO) as every selection logs them. TRL's own metrics (`reward`, `completions/*`)
    average over every round generated.

    **Generation backends**: every round calls TRL's own generation and scoring with its prompts laid
    out as TRL's `RepeatSampler` lays them out (each prompt's rows consecutive, split evenly over the processes), so
    it uses whatever backend TRL uses: HF `generate`, transformers continuous batching, vLLM colocate or server (vLLM
    weights are synced once per optimizer step, so every round of a step samples from the same policy). Only HF
    `generate` is tested here (CPU); vLLM colocate/server and DeepSpeed/FSDP are untested. Not supported: multimodal
    rollouts (clear error).

    **Memory**: only rewards are gathered (by TRL); each process keeps its own rows of the kept groups across rounds,
    and `rollout.redistribute_rows` then moves rows straight to the process that trains them (one all-to-all per
    key). No process holds the global rollout: the peak is about one local round (at most `max_oversample_factor`
    local generation batches) plus the local kept rows (a global copy of 512 x 16 rows of 20k tokens would be about
    3.4 GB on every GPU). The over-sampled first round gathers the dataloader's *inputs* (prompt rows, not
    rollouts) of every process, to lay the round out as TRL's sampler would.
    """

    _tag_names = ["trl", "trl-ppo-variants", "dapo"]
    config_class = DAPOConfig
    selection_metric_prefix = "dapo"

    def __init__(self, model, reward_funcs=None, args: DAPOConfig | None = None, **kwargs):
        args = self.resolve_args(args)
        self._overlong_func = None
        funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
        penalties = [getattr(f, "__name__", type(f).__name__) for f in funcs if is_overlong_penalty(f)]
        if args.overlong_penalty:
            check(not penalties, "overlong_penalty",
                  f"False when reward_funcs holds an overlong penalty ({', '.join(penalties)}: DAPO's own shaping "
                  "would apply it a second time)", True)
            self._overlong_func = get_soft_overlong_punishment(
                args.max_completion_length, args.effective_overlong_cache_length)
        super().__init__(model, reward_funcs, args=args, **kwargs)

        # the reward table the advantages read is TRL's columns (the user's reward functions, then any
        # environment-owned rewards) plus, with the shaping on, one last column: the shaping
        self._overlong_index = len(self.reward_funcs) if self._overlong_func is not None else None
        # an overlong penalty among the user's rewards (with the shaping off) scores length, not the task
        self._task_columns = [i for i, f in enumerate(self.reward_funcs) if not is_overlong_penalty(f)]
        if args.filter_metric == "reward":
            check(len(self._task_columns) > 0, "filter_metric",
                  "a reward function name when the only reward is the overlong shaping", args.filter_metric)

    # -------------------------------------------------------------------------------------------- advantages
    def compute_advantages(self, rewards, batch, group_size):
        return self.grpo_group_advantages(rewards, group_size)

    def scorable_columns(self):
        return self._task_columns  # the overlong shaping scores every completion: it says nothing about the task

    def reward_column_weights(self) -> torch.Tensor:
        weights = super().reward_column_weights()
        if self._overlong_index is None:
            return weights
        return torch.cat([weights, torch.ones(1, dtype=weights.dtype, device=weights.device)])

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards (the user's columns, returned to TRL as they are) plus the overlong shaping as an extra
        column of the captured table (gathered in the same global row order), NaN on the rows no reward function
        scored: a completion without a task reward is unscorable, its shaping alone is no reward."""
        rewards_per_func = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        if self._overlong_func is None:
            return rewards_per_func
        local = torch.tensor(self._overlong_func(completion_ids=completion_ids_list), dtype=rewards_per_func.dtype,
                             device=rewards_per_func.device)
        shaping = self.accelerator.gather(local)
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["dapo/overlong_penalty"].append(shaping.mean().item())
        self._metrics[mode]["dapo/frac_overlong_penalized"].append((shaping < 0).float().mean().item())
        shaping = torch.where(torch.isnan(rewards_per_func).all(dim=1), torch.nan, shaping)
        self._captured_rewards_per_func = torch.cat([self._captured_rewards_per_func, shaping.unsqueeze(1)], dim=1)
        return rewards_per_func

    def filter_values(self, rewards_per_func: torch.Tensor) -> torch.Tensor:
        """The dynamic-sampling filter metric per row: (N, F) -> (N,), NaN where unscorable."""
        if self.args.filter_metric != "reward":
            return rewards_per_func[:, self.reward_func_names.index(self.args.filter_metric)]
        sub = rewards_per_func[:, self._task_columns]
        weights = self.reward_weights.to(sub.device)[self._task_columns]
        values = (sub * weights.unsqueeze(0)).nansum(dim=1)
        values[torch.isnan(sub).all(dim=1)] = float("nan")
        return values
