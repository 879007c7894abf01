"""VAPO: Value-based Augmented Proximal Policy Optimization (Yue et al., arXiv 2504.05118).

PPO (see `ppo.py`) plus the paper's seven modifications, each switchable by config so that an ablation is one flag:

1. Value pre-training (Sec. 3.1): the first `value_pretrain_steps` optimizer steps train only the critic, on
   Monte-Carlo returns (`lam_critic = 1`) of samples from the frozen initial policy.
2. Decoupled GAE (Sec. 3.1): the critic's targets use `lam_critic`, the policy's advantages their own lambda.
3. Length-adaptive GAE (Sec. 4.1, Eq. 9): `lam_policy = 1 - 1 / (alpha * l)` per completion of length `l`.
4. Token-level policy loss (`loss_type="dapo"`, Sec. 4.1) and 5. Clip-Higher (`epsilon=0.2`, `epsilon_high=0.28`,
   Sec. 4.2), both from `GRPOTrainer`.
6. Positive-example LM loss (Sec. 4.2, Eq. 11): `positive_lm_coef * NLL` on the tokens of the completions judged
   correct.
7. Group sampling (Sec. 4.2): `num_generations` completions per prompt (paper: 512 prompts x 16; the default stays
   TRL's 8 so that the default batch of 8 per device holds whole groups; the recipe sets 16).

Value pre-training is PPO's critic warm-up (`PPOConfig.critic_warmup_steps`, see `ppo.py` for how the policy is held
still, its optimizer state reset and its learning-rate schedule started when the warm-up ends); `value_pretrain_steps`
is its name here. The phase is `global_step < value_pretrain_steps`, so it survives checkpoint/resume with the
`TrainerState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..advantages import length_adaptive_lambda
from .. import rollout
from ..errors import check
from ..losses import positive_example_nll
from .ppo import PPOConfig, PPOTrainer


@dataclass
class VAPOConfig(PPOConfig):
    r"""
    Configuration for [`VAPOTrainer`]: [`PPOConfig`] with VAPO's fields (arXiv 2504.05118) and its defaults.

    Paper settings (Sec. 5.1): AdamW, actor lr 1e-6 (`learning_rate`, TRL's default), critic lr 2e-6, warm-up then
    constant schedule (set `lr_scheduler_type="constant_with_warmup"`; the policy's schedule starts when value
    pre-training ends, the critic's at step 0), 512 prompts x 16 samples per rollout, mini-batch 512, value
    pre-training 50 steps, `lam_critic=1.0`, `alpha=0.05`, `mu=0.1`, clip 0.2 / 0.28, token-level loss.

    Choices where the paper is silent:
    - KL: `kl_in_reward_coef=0.0` and `beta=0.0`. VAPO names no KL term or coefficient; it builds on DAPO (same
      team), which removes the KL penalty for long chain-of-thought reasoning with rule-based rewards, and the paper's
      ablations compare against DAPO. Set either to a positive value to add one (KL in the reward as in PPO, or TRL's
      loss term).
    - Group size: `num_generations` keeps TRL's default (8, with its per-device batch of 8); the paper samples 16 per
      prompt, which the recipe sets together with a matching batch size.
    - Maximum length: `max_completion_length` keeps TRL's default so that a run fits any machine; the recipe
      (`recipes/`) uses 20480, DAPO's setting for the same benchmark (AIME 2024, Qwen2.5-32B).
    - Critic learning rate: `critic_learning_rate=None` means twice `learning_rate`, the paper's ratio (2e-6 for the
      actor's 1e-6, which is what the defaults give), so that a run at another policy rate keeps the critic ahead
      of the policy as the paper does (a fixed 2e-6 under a policy rate of 2e-5 would make the critic ten times
      slower than the policy). Set it to fix the critic's rate. With `critic_backbone="lora"` (not in the paper),
      ten times that, as for PPO's LoRA critic.
    - Critic initialisation: the paper initialises the critic from a reward model and pre-trains it against that
      model. With rule-based rewards there is no reward model: the critic is initialised from the policy (a new scalar
      head on the policy's backbone), or from `value_model_path` when given, then pre-trained on the rule rewards.
    - Critic backbone: `critic_backbone="full"` (the paper trains a full value model), unlike PPO's `"lora"` default.
      On SmolLM2 (the demo's settings) VAPO's LoRA critic learned far less than its full critic: the
      length-adaptive lambda makes short completions' advantages one-step TD errors of the critic (the docs' page
      "The critic" has the measurements).
    - "Correct" completions for the positive-example loss: total (weighted) reward >= `positive_reward_threshold`
      (default 1.0, the reward of a correct answer under TRL's `accuracy_reward` and the paper's +1/-1 verifier), or,
      with `positive_reward_func`, that reward function's own reward >= the threshold (use this when a format reward
      is added to the accuracy reward).

    Parameters:
        value_pretrain_steps (`int`, *optional*, defaults to `50`):
            Optimizer steps at the start during which only the critic learns (0 disables value pre-training): PPO's
            `critic_warmup_steps` under the paper's name. The policy's learning-rate schedule (warm-up, decay) starts
            when it ends; the critic's runs from step 0. Must be smaller than `max_steps`. Resumable.
        critic_warmup_steps (`int` or `None`, *optional*, defaults to `None`):
            The same setting under PPO's name: leave it unset, or equal to `value_pretrain_steps`.
        lam_critic (`float`, *optional*, defaults to `1.0`):
            GAE lambda of the critic's targets (1.0: Monte-Carlo returns, unbiased).
        lam_policy (`float`, *optional*, defaults to `0.95`):
            GAE lambda of the policy's advantages when `length_adaptive_alpha` is None (decoupled GAE alone).
        length_adaptive_alpha (`float` or `None`, *optional*, defaults to `0.05`):
            Length-adaptive GAE: `lam_policy = 1 - 1 / (alpha * l)` per completion of `l` valid tokens, clamped to
            [0, 1], so completions of at most `1 / alpha` (20) tokens get `lam_policy = 0` (one-step TD advantages)
            and long ones approach 1. `None` disables it (`lam_policy` is used).
        positive_lm_coef (`float`, *optional*, defaults to `0.1`):
            `mu` of the positive-example LM loss (0 disables it).
        positive_reward_threshold (`float`, *optional*, defaults to `1.0`):
            A completion is positive ("correct") when its reward is at least this.
        positive_reward_func (`str` or `None`, *optional*, defaults to `None`):
            Name of the reward function whose reward decides correctness (its raw value, before `reward_weights`);
            `None`: the weighted total reward.

    `lam` (PPO's single lambda) is not used: VAPO's lambdas are `lam_critic` and `lam_policy`.
    """

    value_pretrain_steps: int = field(
        default=50, metadata={"help": "Optimizer steps at the start that train only the critic (0 disables)."}
    )
    lam_critic: float = field(default=1.0, metadata={"help": "GAE lambda of the critic's targets."})
    lam_policy: float = field(
        default=0.95, metadata={"help": "GAE lambda of the policy's advantages when length_adaptive_alpha is None."}
    )
    length_adaptive_alpha: float | None = field(
        default=0.05, metadata={"help": "Length-adaptive GAE: lam_policy = 1 - 1/(alpha*l); None disables it."}
    )
    positive_lm_coef: float = field(
        default=0.1, metadata={"help": "Coefficient mu of the NLL on correct completions (0 disables it)."}
    )
    positive_reward_threshold: float = field(
        default=1.0, metadata={"help": "A completion is correct when its reward is >= this."}
    )
    positive_reward_func: str | None = field(
        default=None,
        metadata={"help": "Reward function whose reward decides correctness; None: the weighted total reward."},
    )
    critic_warmup_steps: int | None = field(
        default=None, metadata={"help": "PPO's name of value_pretrain_steps: leave unset (or equal)."}
    )
    # defaults that differ from PPOConfig
    critic_backbone: str = field(
        default="full",
        metadata={"help": "'full' (VAPO's default): a trained copy of the backbone; 'lora': a LoRA adapter over frozen "
                          "weights plus the head."},
    )
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Clip-Higher upper bound (VAPO: 0.28)."})
    loss_type: str = field(default="dapo", metadata={"help": "Token-level policy loss (VAPO: 'dapo')."})
    critic_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Critic learning rate; None: 2 x learning_rate (the paper's 2e-6 for 1e-6), 20 x with a LoRA "
                          "critic."},
    )
    kl_in_reward_coef: float = field(
        default=0.0, metadata={"help": "KL-in-reward coefficient (VAPO names none: 0, as DAPO)."}
    )

    warmup_field: ClassVar[str] = "value_pretrain_steps"

    def uses_token_level_normalizer(self) -> bool:
        return super().uses_token_level_normalizer() or self.positive_lm_coef > 0  # the NLL is a token mean

    @property
    def full_critic_learning_rate(self) -> float:
        return 2.0 * self.learning_rate

    def __post_init__(self):
        check(self.critic_warmup_steps in (None, self.value_pretrain_steps), "critic_warmup_steps",
              f"None or value_pretrain_steps={self.value_pretrain_steps} (VAPO's name for it)",
              self.critic_warmup_steps)
        self.critic_warmup_steps = self.value_pretrain_steps
        super().__post_init__()
        check(0.0 <= self.lam_critic <= 1.0, "lam_critic", "a number in [0, 1]", self.lam_critic)
        check(0.0 <= self.lam_policy <= 1.0, "lam_policy", "a number in [0, 1]", self.lam_policy)
        if self.length_adaptive_alpha is not None:
            check(self.length_adaptive_alpha > 0, "length_adaptive_alpha", "a number > 0 or None",
                  self.length_adaptive_alpha)
        check(self.positive_lm_coef >= 0, "positive_lm_coef", "a number >= 0", self.positive_lm_coef)


class VAPOTrainer(PPOTrainer):
    """VAPO (arXiv 2504.05118) on top of TRL's `GRPOTrainer` (see the module docstring and [`VAPOConfig`]).

    Logged on top of PPO's: `value_pretraining` (1 during value pre-training), `positive/fraction` (share of
    completions judged correct), `positive/nll` (mean NLL of their tokens).
    """

    _tag_names = ["trl", "trl-ppo-variants", "vapo"]
    config_class = VAPOConfig
    warmup_metric = "value_pretraining"

    def __init__(self, model, reward_funcs=None, args: VAPOConfig | None = None, **kwargs):
        super().__init__(model, reward_funcs, args=args, **kwargs)
        name = self.args.positive_reward_func
        if name is not None and name not in self.reward_func_names:
            check(False, "positive_reward_func", f"one of the reward function names {self.reward_func_names}", name)

    # -------------------------------------------------------------------------------------------- value pre-training
    def in_value_pretraining(self) -> bool:
        """True during the first `value_pretrain_steps` optimizer steps (PPO's critic warm-up)."""
        return self.in_critic_warmup()

    def step_token_counts(self, inputs):
        counts = super().step_token_counts(inputs)
        if "positive" in inputs:  # the positive-example NLL's token mean is over the correct completions' tokens
            mask = rollout.loss_mask(inputs) * inputs["positive"].unsqueeze(1)
            counts["num_positive_tokens"] = mask.sum()
        return counts

    # -------------------------------------------------------------------------------------------- advantages
    def gae_lambdas(self, valid):
        if self.args.length_adaptive_alpha is not None:
            lam_policy = length_adaptive_lambda(valid.sum(dim=1), self.args.length_adaptive_alpha)
        else:
            lam_policy = self.args.lam_policy
        return lam_policy, self.args.lam_critic

    def positive_rows(self, rewards: torch.Tensor) -> torch.Tensor:
        """(N,) bool: completions judged correct (see `VAPOConfig`); NaN rewards are never correct."""
        name = self.args.positive_reward_func
        if name is not None:
            per_func = self._captured_rewards_per_func
            if per_func is None or per_func.shape[0] != rewards.shape[0]:
                raise RuntimeError("positive_reward_func needs the rewards of every row (no row selection)")
            scores = per_func[:, self.reward_func_names.index(name)].to(rewards.device)
        else:
            scores = rewards
        return torch.nan_to_num(scores, nan=float("-inf")) >= self.args.positive_reward_threshold

    def extra_targets(self, rewards, batch, valid):
        positive = self.positive_rows(rewards)
        mode = "train" if self.model.training else "eval"
        scorable = ~torch.isnan(rewards)
        self._metrics[mode]["positive/fraction"].append(
            (positive.sum() / scorable.sum().clamp(min=1)).item()
        )
        num_positive_tokens = (valid * positive.to(valid.dtype).unsqueeze(1)).sum()
        return {"positive": positive.to(valid.dtype), "num_positive_tokens": num_positive_tokens}

    # -------------------------------------------------------------------------------------------- positive-example LM
    def extra_policy_loss(self, logps, inputs, mask, aggregate):
        if self.args.positive_lm_coef == 0.0:
            return None
        nll, positive_mask = positive_example_nll(logps, mask, inputs["positive"])
        # the paper's token mean over the correct completions of the batch: DAPO's token-level reduction, with the
        # number of correct-completion tokens of the generation batch as the denominator (0 when none is correct)
        loss = aggregate(nll, positive_mask, loss_type="dapo", num_items_in_batch=inputs["num_positive_tokens"])
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["positive/nll"].append(self._global_mean(nll, positive_mask))
        return self.args.positive_lm_coef * loss


__all__ = ["VAPOConfig", "VAPOTrainer"]
