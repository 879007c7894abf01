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

How the policy is held still during value pre-training. Policy and critic share one optimizer (see `critic.py`), so
"not updated" is enforced three ways: the policy part of the loss is multiplied by 0 (its gradients are exactly zero:
the forward still runs, because DDP and ZeRO expect a gradient for every parameter), the policy's param groups get
weight decay 0 (AdamW's decoupled decay would shrink the weights even with zero gradients), and when pre-training ends
the policy's optimizer state is reset (Adam's step counter would otherwise have advanced through the pre-training
steps, damping the first real updates through its bias correction); zero gradients leave Adam's moments at zero.
The pre-training phase is `global_step < value_pretrain_steps`, so it survives checkpoint/resume with the
`TrainerState`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..advantages import length_adaptive_lambda
from ..losses import positive_example_nll
from .base import check
from .ppo import GROUP_ROLE, GROUP_WEIGHT_DECAY, PPOConfig, PPOTrainer, _innermost_optimizer


@dataclass
class VAPOConfig(PPOConfig):
    r"""
    Configuration for [`VAPOTrainer`]: [`PPOConfig`] with VAPO's fields (arXiv 2504.05118) and its defaults.

    Paper settings (Sec. 5.1): AdamW, actor lr 1e-6 (`learning_rate`, TRL's default), critic lr 2e-6, warm-up then
    constant schedule, 512 prompts x 16 samples per rollout, mini-batch 512, value pre-training 50 steps,
    `lam_critic=1.0`, `alpha=0.05`, `mu=0.1`, clip 0.2 / 0.28, token-level loss.

    Choices where the paper is silent:
    - KL: `kl_in_reward_coef=0.0` and `beta=0.0`. VAPO names no KL term or coefficient; it builds on DAPO (same
      team), which removes the KL penalty for long chain-of-thought reasoning with rule-based rewards, and the paper's
      ablations compare against DAPO. Set either to a positive value to add one (KL in the reward as in PPO, or TRL's
      loss term).
    - Group size: `num_generations` keeps TRL's default (8, with its per-device batch of 8); the paper samples 16 per
      prompt, which the recipe sets together with a matching batch size.
    - Maximum length: `max_completion_length` keeps TRL's default so that a run fits any machine; the recipe
      (`recipes/`) uses 20480, DAPO's setting for the same benchmark (AIME 2024, Qwen2.5-32B).
    - Critic initialisation: the paper initialises the critic from a reward model and pre-trains it against that
      model. With rule-based rewards there is no reward model: the critic is initialised from the policy (a new scalar
      head on the policy's backbone), or from `value_model_path` when given, then pre-trained on the rule rewards.
    - "Correct" completions for the positive-example loss: total (weighted) reward >= `positive_reward_threshold`
      (default 1.0, the reward of a correct answer under TRL's `accuracy_reward` and the paper's +1/-1 verifier), or,
      with `positive_reward_func`, that reward function's own reward >= the threshold (use this when a format reward
      is added to the accuracy reward).

    Parameters:
        value_pretrain_steps (`int`, *optional*, defaults to `50`):
            Optimizer steps at the start during which only the critic learns (0 disables value pre-training).
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
    # defaults that differ from PPOConfig
    epsilon_high: float | None = field(default=0.28, metadata={"help": "Clip-Higher upper bound (VAPO: 0.28)."})
    loss_type: str = field(default="dapo", metadata={"help": "Token-level policy loss (VAPO: 'dapo')."})
    critic_learning_rate: float | None = field(default=2e-6, metadata={"help": "Critic learning rate (VAPO: 2e-6)."})
    kl_in_reward_coef: float = field(
        default=0.0, metadata={"help": "KL-in-reward coefficient (VAPO names none: 0, as DAPO)."}
    )

    def __post_init__(self):
        super().__post_init__()
        check(isinstance(self.value_pretrain_steps, int) and self.value_pretrain_steps >= 0, "value_pretrain_steps",
              "an integer >= 0", self.value_pretrain_steps)
        check(0.0 <= self.lam_critic <= 1.0, "lam_critic", "a number in [0, 1]", self.lam_critic)
        check(0.0 <= self.lam_policy <= 1.0, "lam_policy", "a number in [0, 1]", self.lam_policy)
        if self.length_adaptive_alpha is not None:
            check(self.length_adaptive_alpha > 0, "length_adaptive_alpha", "a number > 0 or None",
                  self.length_adaptive_alpha)
        check(self.positive_lm_coef >= 0, "positive_lm_coef", "a number >= 0", self.positive_lm_coef)
        if self.max_steps > 0 and self.value_pretrain_steps >= self.max_steps:
            check(False, "value_pretrain_steps", f"fewer than max_steps={self.max_steps} (the policy would never be "
                  "trained)", self.value_pretrain_steps)


class VAPOTrainer(PPOTrainer):
    """VAPO (arXiv 2504.05118) on top of TRL's `GRPOTrainer` (see the module docstring and [`VAPOConfig`]).

    Logged on top of PPO's: `value_pretraining` (1 during value pre-training), `positive/fraction` (share of
    completions judged correct), `positive/nll` (mean NLL of their tokens).
    """

    _tag_names = ["trl", "trl-ppo-variants", "vapo"]
    config_class = VAPOConfig

    def __init__(self, model, reward_funcs, args: VAPOConfig | None = None, **kwargs):
        super().__init__(model, reward_funcs, args=args, **kwargs)
        name = self.args.positive_reward_func
        if name is not None and name not in self.reward_func_names:
            check(False, "positive_reward_func", f"one of the reward function names {self.reward_func_names}", name)

    # -------------------------------------------------------------------------------------------- value pre-training
    def in_value_pretraining(self) -> bool:
        """True during the first `value_pretrain_steps` optimizer steps (read from the resumable TrainerState)."""
        return self.state.global_step < self.args.value_pretrain_steps

    def policy_loss_scale(self) -> float:
        return 0.0 if self.in_value_pretraining() else 1.0

    def _hold_policy(self, frozen: bool) -> None:
        """Switch the policy's weight decay off while it is frozen; reset its optimizer state when pre-training ends.

        Stateless (decided from `global_step`) so that resuming anywhere does the right thing: the reset happens at
        `global_step == value_pretrain_steps` (idempotent within the accumulation window: no step has run yet).
        """
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            if group.get(GROUP_ROLE) == "policy":
                group["weight_decay"] = 0.0 if frozen else group.get(GROUP_WEIGHT_DECAY, group["weight_decay"])
        end = self.args.value_pretrain_steps
        if not frozen and end > 0 and self.state.global_step == end:
            self._reset_policy_optimizer_state()

    def _reset_policy_optimizer_state(self) -> int:
        """Drop the optimizer state of the policy's parameters; returns how many state entries were dropped."""
        inner = _innermost_optimizer(self.optimizer)
        policy_groups = {i for i, g in enumerate(inner.param_groups) if g.get(GROUP_ROLE) == "policy"}
        zero3 = self.optimizer
        while zero3 is not None and not hasattr(zero3, "sub_group_to_group_id"):
            zero3 = getattr(zero3, "optimizer", None)
        if zero3 is not None:  # ZeRO-3 keys the state by flat fp32 sub-group partitions
            tensors = [zero3.fp32_partitioned_groups_flat[sub] for sub, gid in zero3.sub_group_to_group_id.items()
                       if gid in policy_groups]
        else:  # torch optimizers, and ZeRO-1/2 (one flat partition per group)
            tensors = [p for i in policy_groups for p in inner.param_groups[i]["params"]]
        return sum(inner.state.pop(tensor, None) is not None for tensor in tensors)

    def _compute_loss(self, model, inputs):
        if self.model.training:
            frozen = self.in_value_pretraining()
            self._hold_policy(frozen)
            self._metrics["train"]["value_pretraining"].append(float(frozen))
        return super()._compute_loss(model, inputs)

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
