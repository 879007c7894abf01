"""PPO with a learned value model (Schulman et al., arXiv 1707.06347; RLHF form of Ouyang et al., arXiv 2203.02155).

On top of `GRPOTrainer`'s generation, rewards, vLLM and PEFT:

- a critic (see `critic.py`): a backbone plus a scalar head, attached to the policy as `policy.critic`, so that DDP and
  DeepSpeed ZeRO-2/3 prepare one model and one optimizer; checkpoints hold it in `value_model/`, apart from the policy's
  weights (what transformers pushes from a checkpoint is then the policy alone). `critic_backbone="lora"` (PPO's
  default) trains a LoRA adapter over frozen weights shared with the PEFT policy's base model or the reference model
  where there is one (else a frozen copy): the critic then costs an adapter and a head; `"full"` (VAPO's default)
  trains a copy of the backbone;
- vision-language models: the critic gets the batch's image inputs at rollout and in the loss, as the policy's
  forward does (see `critic.py`);
- rollout: the critic's values of the sampling-time state (no grad) travel in the batch ("old_values"); token rewards
  are the outcome at the last valid token minus `kl_in_reward_coef * k1` at every token (base's `reference_kl`);
  GAE (`advantages.gae`) gives advantages and returns; advantages are whitened over the valid tokens of the whole
  generation batch, across processes (`needs_global_batch`); returns travel in the batch ("returns", "value_mask");
- loss: `GRPOTrainer`'s PPO-clip policy loss (Clip-Higher through `epsilon_high`; dual-clip through `clip_ratio_c`,
  shared by every trainer in `base.py`), plus `vf_coef` times the clipped value loss, reduced the way `loss_type`
  reduces the policy loss (`losses.aggregate_token_loss`) over the tokens that have a value target (`value_mask`: the
  loss tokens of the completions with a reward). Its normaliser counts those tokens, not all loss tokens: for the
  token-level loss types it is `num_value_tokens`, the value-target tokens of the optimizer step (counted like
  `num_items_in_batch`), so the value loss is the mean over the targets and completions whose reward is None (no
  target) do not dilute it.

Optimizer. One optimizer, param groups split by owner: the critic's groups get `critic_learning_rate`; gradient
clipping (`max_grad_norm`) acts on the joint norm, which `vf_coef` keeps from being dominated by the critic.

Critic warm-up (`critic_warmup_steps`; VAPO's value pre-training is the same mechanism under its paper's name). The
first optimizer steps train only the critic, on samples of the frozen initial policy (OpenRLHF `freezing_steps`,
NeMo-RL `policy_training_start_step`, ROLL `critic_warmup`). Policy and critic share one optimizer, so "not updated" is
enforced four ways: the policy part of the loss is multiplied by 0 (its gradients are exactly zero: the forward still
runs, because DDP and ZeRO expect a gradient for every parameter), the policy's learning rate is 0, its param groups
get weight decay 0 (AdamW's decoupled decay would shrink the weights even with zero gradients), and when the warm-up
ends the policy's optimizer state is reset (Adam's step counter would otherwise have advanced through the warm-up,
damping the first real updates through its bias correction). The phase is `global_step < critic_warmup_steps`, so it
survives checkpoint/resume with the `TrainerState`.

Learning-rate schedules with a warm-up. The policy's schedule (`lr_scheduler_type`, `warmup_steps`, decay) starts
when the critic warm-up ends and spans the remaining `max_steps - critic_warmup_steps` steps, as if the policy's
training started then (its first step has the rate the schedule gives step 0, e.g. no decay yet); the critic keeps the
plain schedule over all steps, from step 0. Without a critic warm-up the scheduler is transformers' own.
"""

from __future__ import annotations

import functools
import os
import shutil
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from accelerate.utils import is_peft_model
from transformers.trainer_utils import HubStrategy
from trl.trainer.callbacks import SyncRefModelCallback

from .. import rollout
from ..advantages import gae, masked_mean, masked_whiten, token_rewards_from_outcome
from ..critic import (
    CRITIC_BACKBONES,
    VALUE_MODEL_DIR,
    unwrap_module,
    attach_critic,
    build_critic,
    critic_parameters,
    critic_values,
    detached_critic,
    explained_variance,
    get_critic,
    holds_critic_weights,
    is_critic_key,
    load_critic,
    policy_module,
    save_critic,
    skip_critic_params,
    split_critic_state_dict,
)
from ..errors import check
from ..losses import clipped_value_loss
from ..process import StepRewardFields, StepRewardsMixin
from .base import VariantConfig, VariantTrainer

#: key of the optimizer param groups saying whose parameters they hold ("policy" or "critic")
GROUP_ROLE = "trl_ppo_variants_role"
#: the weight decay the group was created with (the live value is switched off while the policy is frozen)
GROUP_WEIGHT_DECAY = "trl_ppo_variants_weight_decay"
#: `lr_scheduler_type`s that are not a `LambdaLR` (their rate depends on metrics): no shifted policy schedule
UNSHIFTABLE_SCHEDULERS = ("reduce_lr_on_plateau", "greedy")
#: `critic_learning_rate=None` with `critic_backbone="lora"`: this many times the full critic's default rate. A LoRA
#: adapter's best rate is about 10x full fine-tuning's (Schulman et al., "LoRA Without Regret", Thinking Machines,
#: 2025; Biderman et al., arXiv 2405.09673); on SmolLM2 the LoRA critic at the full critic's rate learned less (README)
LORA_CRITIC_LR_SCALE = 10.0


@dataclass
class PPOConfig(StepRewardFields, VariantConfig):
    r"""
    Configuration for [`PPOTrainer`]: [`~trl.GRPOConfig`] with a value model, GAE and PPO's value loss.

    The policy loss is `GRPOTrainer`'s PPO-clip loss (`epsilon`, `epsilon_high`, `loss_type`, `num_iterations` = PPO
    epochs, `steps_per_generation` = mini-batches per rollout); `num_generations` completions are sampled per prompt
    as in GRPO (the advantage does not use the group). Defaults follow TRL's former `PPOConfig` (`vf_coef=0.1`,
    `cliprange_value=0.2`, `gamma=1.0`, `lam=0.95`, KL-in-reward `0.05` with k1).

    Step rewards (process supervision): `step_reward_funcs=[...]` passed to the trainer, or a process reward model
    (`process_reward_model_path`), put each step's reward at the token that ends the step, besides the outcome at the
    last token, so GAE sees dense rewards. Fields `step_separator`, `process_reward_model_path`,
    `process_reward_model_style`, `process_reward_model_step_tag`: see [`~trl_ppo_variants.process.StepRewardFields`].

    Parameters:
        value_model_path (`str` or `None`, *optional*, defaults to `None`):
            Checkpoint to initialise the critic from: its base model, and its scalar head when it holds one (`score`,
            `classifier`, or TRL's former `v_head.summary`, with one output), e.g. a value or reward model; a head it
            does not hold starts near zero. `None`: the policy's own weights with a new scalar head.
        critic_backbone (`str`, *optional*, defaults to `"lora"`):
            `"lora"`: a LoRA adapter over frozen base weights, plus the head: with a PEFT (LoRA) policy, a second
            adapter on the policy's own base model; with a full-fine-tuning policy and a reference model (PPO's
            default KL in the reward loads one), the reference model's weights; otherwise (no reference,
            `sync_ref_model=True`, `value_model_path`, DeepSpeed ZeRO-3) a frozen copy. The trainer's `critic_base`
            says which. `"full"`: the critic trains a copy of the backbone (its own gradients and optimizer state).
            `"lora"` is the default because on SmolLM2 it learned at least as well as the full critic at a fraction
            of its memory: the measurements are on the docs' page "The critic". VAPO keeps `"full"`.
        critic_lora_r (`int`, *optional*, defaults to `16`):
            Rank of the LoRA critic's adapter.
        critic_lora_alpha (`float`, *optional*, defaults to `32`):
            LoRA alpha of the critic's adapter (its scale is `alpha / r`).
        critic_lora_target_modules (`list[str]` or `None`, *optional*, defaults to `None`):
            Linear layers of the backbone the critic's adapter covers (names as PEFT matches them); `None`: every
            linear layer of the backbone ("all-linear").
        vf_coef (`float`, *optional*, defaults to `0.1`):
            Weight of the value loss in the total loss.
        critic_learning_rate (`float` or `None`, *optional*, defaults to `None`):
            Learning rate of the critic's parameters (its own optimizer param groups, same schedule shape).
            `None`: `learning_rate` for the full critic, 10 x `learning_rate` for the LoRA critic (a LoRA adapter's
            usual ratio to full fine-tuning).
        cliprange_value (`float`, *optional*, defaults to `0.2`):
            The value loss is `0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2)` with this `c`.
        gamma (`float`, *optional*, defaults to `1.0`):
            Discount of GAE.
        lam (`float`, *optional*, defaults to `0.95`):
            Lambda of GAE (for both the advantages and the value targets).
        critic_warmup_steps (`int`, *optional*, defaults to `0`):
            Optimizer steps at the start during which only the critic learns (the policy is frozen and its
            learning-rate schedule starts after them; see the module docstring). Must be smaller than `max_steps`;
            refused with `lr_scheduler_type` `"reduce_lr_on_plateau"` or `"greedy"` (their rate is not a function of
            the step, so it cannot be shifted). Resumable.
        save_value_model (`bool`, *optional*, defaults to `True`):
            When exporting (`trainer.save_model()`), save the critic to `<output_dir>/value_model`. The exported
            policy never holds the critic's weights. Also decides whether the pushes made from checkpoints
            (`push_to_hub=True`) upload the critic. Checkpoints always hold the critic (in `value_model/`).
        kl_in_reward_coef (`float`, *optional*, defaults to `0.05`):
            Coefficient of the per-token k1 KL to the reference subtracted from the token rewards (TRL's former
            `PPOConfig.kl_coef`). `0.0` skips the reference model.
    """

    value_model_path: str | None = field(
        default=None,
        metadata={"help": "Checkpoint to initialise the critic from; None: the policy's weights with a new head."},
    )
    critic_backbone: str = field(
        default="lora",
        metadata={"help": "'lora': a LoRA adapter over frozen weights (shared with the PEFT policy's base or the "
                          "reference model where possible) plus the head; 'full': a trained copy of the backbone."},
    )
    critic_lora_r: int = field(default=16, metadata={"help": "Rank of the LoRA critic's adapter."})
    critic_lora_alpha: float = field(default=32, metadata={"help": "LoRA alpha of the critic's adapter."})
    critic_lora_target_modules: list[str] | None = field(
        default=None, metadata={"help": "Linear layers the LoRA critic's adapter covers; None: every linear layer."}
    )
    vf_coef: float = field(default=0.1, metadata={"help": "Weight of the value loss."})
    critic_learning_rate: float | None = field(
        default=None,
        metadata={"help": "Learning rate of the critic; None: learning_rate (full critic), 10 x learning_rate (LoRA)."},
    )
    cliprange_value: float = field(default=0.2, metadata={"help": "Clip range of the value around the old value."})
    gamma: float = field(default=1.0, metadata={"help": "Discount factor of GAE."})
    lam: float = field(default=0.95, metadata={"help": "Lambda of GAE."})
    critic_warmup_steps: int = field(
        default=0, metadata={"help": "Optimizer steps at the start that train only the critic (0 disables)."}
    )
    save_value_model: bool = field(
        default=True, metadata={"help": "Save the critic to <output_dir>/value_model when exporting."}
    )
    kl_in_reward_coef: float = field(
        default=0.05,
        metadata={"help": "Coefficient of the per-token k1 KL subtracted from the token rewards (loads the ref)."},
    )

    def __post_init__(self):
        # The critic is called outside DDP's forward: DDP's unused-parameter search would mark its parameters ready
        # twice ("Expected to mark a variable ready only once").
        if self.ddp_find_unused_parameters is None:
            self.ddp_find_unused_parameters = False
        super().__post_init__()
        check(self.ddp_find_unused_parameters is False, "ddp_find_unused_parameters",
              "False (the critic is called outside DDP's forward)", self.ddp_find_unused_parameters)
        check(self.cliprange_value > 0, "cliprange_value", "a number > 0", self.cliprange_value)
        check(0.0 <= self.gamma <= 1.0, "gamma", "a number in [0, 1]", self.gamma)
        check(0.0 <= self.lam <= 1.0, "lam", "a number in [0, 1]", self.lam)
        check(self.vf_coef >= 0, "vf_coef", "a number >= 0", self.vf_coef)
        check(self.critic_backbone in CRITIC_BACKBONES, "critic_backbone", f"one of {CRITIC_BACKBONES}",
              self.critic_backbone)
        check(isinstance(self.critic_lora_r, int) and self.critic_lora_r > 0, "critic_lora_r", "an integer > 0",
              self.critic_lora_r)
        check(self.critic_lora_alpha > 0, "critic_lora_alpha", "a number > 0", self.critic_lora_alpha)
        if isinstance(self.critic_lora_target_modules, str) and self.critic_lora_target_modules != "all-linear":
            self.critic_lora_target_modules = [self.critic_lora_target_modules]
        if self.critic_learning_rate is not None:
            check(self.critic_learning_rate >= 0, "critic_learning_rate", "a number >= 0 or None",
                  self.critic_learning_rate)
        name = self.warmup_field
        steps = self.critic_warmup_steps
        check(isinstance(steps, int) and steps >= 0, name, "an integer >= 0", steps)
        if self.max_steps > 0 and steps >= self.max_steps:
            check(False, name, f"fewer than max_steps={self.max_steps} (the policy would never be trained)", steps)
        if steps > 0:
            scheduler = getattr(self.lr_scheduler_type, "value", self.lr_scheduler_type)
            check(scheduler not in UNSHIFTABLE_SCHEDULERS, "lr_scheduler_type",
                  f"a step-based schedule (not {UNSHIFTABLE_SCHEDULERS}) with {name} > 0 (the policy's schedule "
                  "starts when the critic warm-up ends)", scheduler)

    def prompt_selection_refused(self):
        return ("the advantages come from a learned critic (GAE), not from the group: a group whose rewards are all "
                "equal still has non-zero advantages and trains the critic")

    #: the name under which the user sets `critic_warmup_steps` (VAPO: `value_pretrain_steps`), for error messages
    warmup_field: ClassVar[str] = "critic_warmup_steps"

    @property
    def full_critic_learning_rate(self) -> float:
        """The full critic's rate when `critic_learning_rate` is None (VAPO: twice the policy's)."""
        return self.learning_rate

    @property
    def effective_critic_learning_rate(self) -> float:
        if self.critic_learning_rate is not None:
            return self.critic_learning_rate
        scale = LORA_CRITIC_LR_SCALE if self.critic_backbone == "lora" else 1.0
        return scale * self.full_critic_learning_rate


class PPOTrainer(StepRewardsMixin, VariantTrainer):
    """PPO with a critic on top of TRL's `GRPOTrainer` (see the module docstring for the design).

    Logged: `value/loss`, `value/clip_frac`, `value/explained_variance` (of the rollout-time values against the
    returns), `value/mean`, `value/return_mean`, `value/learning_rate` (the critic's; transformers' `learning_rate` is
    the policy's), `approx_kl` (`0.5 (log r)^2`), TRL's `clip_ratio/low_mean`, `clip_ratio/high_mean`, with dual-clip
    `clip_ratio/dual_mean`, and with a critic warm-up `critic_warmup` (1 while the policy is frozen; VAPO:
    `value_pretraining`).
    """

    _tag_names = ["trl", "trl-ppo-variants", "ppo"]
    needs_global_batch = True
    captures_policy_logps = True
    config_class = PPOConfig
    #: the logged name of the warm-up flag
    warmup_metric = "critic_warmup"

    def __init__(self, model, reward_funcs=None, args: PPOConfig | None = None, **kwargs):
        args = self.resolve_args(args)
        self._exporting = False
        self._pushing = False
        self._targets = None
        super().__init__(model, reward_funcs, args=args, **kwargs)
        if self.is_fsdp_enabled:
            raise NotImplementedError(f"{type(self).__name__} supports DDP and DeepSpeed ZeRO-1/2/3, not FSDP")
        self._setup_critic()
        for callback in list(self.callback_handler.callbacks):
            if type(callback) is SyncRefModelCallback:  # TRL's pairs every parameter of the model with the reference's
                self.callback_handler.remove_callback(callback)
                self.add_callback(PolicySyncRefModelCallback(ref_model=callback.ref_model,
                                                             accelerator=callback.accelerator))

    # -------------------------------------------------------------------------------------------- critic setup
    def _setup_critic(self):
        args = self.args
        # the reference model's weights are shared by a LoRA critic, unless they move (`sync_ref_model`)
        reference = None if self.ref_model is None or args.sync_ref_model else unwrap_module(self.ref_model)
        # TRL leaves the RNG seeded per process: the new value head (and adapter) must be the same on every rank (and
        # the same as in a single-process run)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(args.seed)
            critic = build_critic(
                self.model, args.value_model_path, critic_backbone=args.critic_backbone, reference=reference,
                lora_r=args.critic_lora_r, lora_alpha=args.critic_lora_alpha,
                lora_target_modules=args.critic_lora_target_modules, trust_remote_code=args.trust_remote_code,
            )
        if not self.is_deepspeed_enabled:  # DeepSpeed places the engine's parameters itself
            device = next(policy_module(self.model).parameters()).device
            critic.to(device)
        # attached after PEFT injected its adapter (TRL does that in __init__): the policy's LoRA never targets the
        # critic
        attach_critic(self.model, critic)
        if self.use_vllm:  # vLLM receives the policy only
            iterate = self.vllm_generation._iter_named_params
            self.vllm_generation._iter_named_params = lambda: skip_critic_params(iterate())

    @property
    def critic(self):
        """The value model (`critic.ValueModel` or `critic.LoraValueModel`)."""
        return get_critic(self.model)

    @property
    def critic_base(self) -> str:
        """Where the critic's backbone weights come from: "own" (a full critic's trained copy), or for a LoRA critic
        "policy_adapter" (the PEFT policy's base model), "reference" (the reference model's) or "copy" (frozen)."""
        return getattr(self.critic, "base_source", "own")

    # -------------------------------------------------------------------------------------------- optimizer
    def create_optimizer(self, model=None):
        """Trainer's optimizer, with each param group split into the policy's and the critic's (critic lr)."""
        fresh = self.optimizer is None
        optimizer = super().create_optimizer(model)
        critic_ids = {id(p) for p in critic_parameters(self.model)}
        if not fresh:  # passed in by the user (`optimizers=`): built before the critic existed, it would never train it
            held = {id(p) for g in optimizer.param_groups for p in g["params"]}
            check(critic_ids <= held, "optimizers", "(None, None) or an optimizer holding the critic's parameters "
                  "(the trainer creates the critic: let it create the optimizer)", "an optimizer without them")
            return optimizer
        groups = []
        for group in optimizer.param_groups:
            for role in ("policy", "critic"):
                params = [p for p in group["params"] if (id(p) in critic_ids) == (role == "critic")]
                if not params:
                    continue  # DeepSpeed indexes its flat partitions by group: no empty groups
                new = {**group, "params": params, GROUP_ROLE: role, GROUP_WEIGHT_DECAY: group.get("weight_decay", 0.0)}
                if role == "critic":
                    new["lr"] = self.args.effective_critic_learning_rate
                    new.pop("initial_lr", None)
                groups.append(new)
        inner = _innermost_optimizer(optimizer)
        inner.param_groups.clear()
        inner.param_groups.extend(groups)
        return optimizer

    def _policy_param_groups(self):
        return [g for g in self.optimizer.param_groups if g.get(GROUP_ROLE) == "policy"]

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        """transformers' scheduler, except with a critic warm-up: then one `LambdaLR` with a rate per param group, the
        policy's schedule shifted to start when the warm-up ends (0 before), the critic's the plain one."""
        warmup = self.args.critic_warmup_steps
        if warmup >= num_training_steps > 0:
            # the run's real length, however it is set (`max_steps` is checked by the config; `num_train_epochs` only
            # gives it here, before the first step): a warm-up as long as the run would never train the policy
            check(False, self.args.warmup_field, f"fewer than the run's {num_training_steps} optimizer steps (from "
                  f"num_train_epochs={self.args.num_train_epochs} or max_steps; the policy would never be trained)",
                  warmup)
        if warmup == 0 or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        optimizer = self.optimizer if optimizer is None else optimizer
        critic_rate = self._schedule_lambda(num_training_steps)
        policy_rate = self._schedule_lambda(max(num_training_steps - warmup, 1))

        def shifted(step):
            return 0.0 if step < warmup else policy_rate(step - warmup)

        rates = [critic_rate if g.get(GROUP_ROLE) == "critic" else shifted for g in optimizer.param_groups]
        self.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, rates)
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def _schedule_lambda(self, num_training_steps: int):
        """The rate multiplier (a function of the step) of transformers' `lr_scheduler_type` over
        `num_training_steps` steps with `warmup_steps` resolved against them, read off a scheduler built on a
        throwaway optimizer (schedules such as "polynomial" read the base rate from `optimizer.defaults`)."""
        from transformers.optimization import get_scheduler

        probe = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=self.args.learning_rate)
        scheduler = get_scheduler(
            self.args.lr_scheduler_type,
            optimizer=probe,
            num_warmup_steps=self.args.get_warmup_steps(num_training_steps),
            num_training_steps=num_training_steps,
            scheduler_specific_kwargs=self.args.lr_scheduler_kwargs,
        )
        return scheduler.lr_lambdas[0]

    # -------------------------------------------------------------------------------------------- critic warm-up
    def in_critic_warmup(self) -> bool:
        """True during the first `critic_warmup_steps` optimizer steps (read from the resumable TrainerState)."""
        return self.state.global_step < self.args.critic_warmup_steps

    def policy_loss_scale(self) -> float:
        """Multiplier of the whole policy part of the loss: 0 during the critic warm-up."""
        return 0.0 if self.in_critic_warmup() else 1.0

    def _hold_policy(self, frozen: bool) -> None:
        """Switch the policy's weight decay off while it is frozen; reset its optimizer state when the warm-up ends.

        Stateless (decided from `global_step`) so that resuming anywhere does the right thing: the reset happens at
        `global_step == critic_warmup_steps` (idempotent within the accumulation window: no step has run yet).
        """
        if self.optimizer is None:
            return
        for group in self.optimizer.param_groups:
            if group.get(GROUP_ROLE) == "policy":
                group["weight_decay"] = 0.0 if frozen else group.get(GROUP_WEIGHT_DECAY, group["weight_decay"])
        end = self.args.critic_warmup_steps
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

    # -------------------------------------------------------------------------------------------- rollout
    @torch.no_grad()
    def rollout_values(self, output: dict) -> torch.Tensor:
        """Values of the current (old) critic on this process's rollout rows: (B, T), 0 on padding."""
        from trl.models.utils import disable_gradient_checkpointing

        input_ids = torch.cat([output["prompt_ids"], output["completion_ids"]], dim=1)
        attention_mask = torch.cat([output["prompt_mask"], output["completion_mask"]], dim=1)
        batch_size = (self.args.per_device_train_batch_size if self.model.training
                      else self.args.per_device_eval_batch_size)
        with disable_gradient_checkpointing(self.model, self.args.gradient_checkpointing_kwargs), \
                self.accelerator.autocast():
            values = critic_values(self.critic, input_ids, attention_mask, output["completion_ids"].shape[1],
                                   batch_size=batch_size, image_fields=rollout.image_inputs(output))
        return torch.where(output["completion_mask"].bool(), values, torch.zeros_like(values))

    def gae_lambdas(self, valid: torch.Tensor):
        """`(lam for the policy's advantages, lam for the critic's targets)`: floats or (N,) tensors."""
        return self.args.lam, self.args.lam

    def extra_targets(self, rewards: torch.Tensor, batch: dict, valid: torch.Tensor) -> dict:
        """More per-row tensors of the global batch to hand to each process (VAPO: which completions are correct)."""
        return {}

    def compute_advantages(self, rewards, batch, group_size):
        mask = rollout.loss_mask(batch).to(torch.float32)
        rewards, step_token_rewards = self.dense_step_rewards(rewards, mask)  # (rewards, None) without step rewards
        scorable = ~torch.isnan(rewards)
        valid = mask * scorable.to(mask.dtype).unsqueeze(1)  # unscorable rows: no advantage, no value target
        token_rewards = token_rewards_from_outcome(rewards, valid, batch.get("kl_in_reward"), self.kl_in_reward_coef)
        if step_token_rewards is not None:
            token_rewards = token_rewards + step_token_rewards * valid
        old_values = torch.where(valid.bool(), batch["old_values"].to(torch.float32), torch.zeros_like(valid))
        lam_policy, lam_critic = self.gae_lambdas(valid)
        gamma = self.args.gamma
        critic_adv, returns = gae(token_rewards, old_values, valid, gamma=gamma, lam=lam_critic)
        if lam_policy is lam_critic:
            policy_adv = critic_adv
        else:  # decoupled GAE (VAPO): the policy's lambda differs from the critic targets'
            policy_adv, _ = gae(token_rewards, old_values, valid, gamma=gamma, lam=lam_policy)
        advantages = masked_whiten(policy_adv, valid)

        self._targets = {"returns": returns, "value_mask": valid, "num_value_tokens": valid.sum(),
                         **self.extra_targets(rewards, batch, valid)}
        mode = "train" if self.model.training else "eval"
        self._metrics[mode]["value/mean"].append(masked_mean(old_values, valid).item())
        self._metrics[mode]["value/return_mean"].append(masked_mean(returns, valid).item())
        ev = explained_variance(old_values, returns, valid)
        if torch.isfinite(ev):
            self._metrics[mode]["value/explained_variance"].append(ev.item())
        return advantages

    def _replace_advantages(self, output, inputs):
        output["old_values"] = self.rollout_values(output)
        self._targets = None
        output = super()._replace_advantages(output, inputs)
        targets, self._targets = self._targets, None
        rows, width = output["completion_mask"].shape
        rank = self.accelerator.process_index
        for key, value in targets.items():
            if value.dim() == 0:  # a batch-wide scalar (e.g. a global token count): the same for every process
                output[key] = value
                continue
            # this process's contiguous share of the global rows, as the base hands out the advantages (and as
            # `rollout.redistribute_rows` does when rows were selected), trimmed to the local completion width
            value = value[rank * rows : (rank + 1) * rows]
            output[key] = value[:, :width] if value.dim() == 2 else value
        return output

    def step_token_counts(self, inputs):
        counts = super().step_token_counts(inputs)
        if "value_mask" in inputs:  # the value loss's token mean is over the tokens with a value target
            counts["num_value_tokens"] = inputs["value_mask"].sum()
        return counts

    # -------------------------------------------------------------------------------------------- loss
    def extra_policy_loss(self, logps, inputs, mask, aggregate) -> torch.Tensor | None:
        """A term added to the policy loss (VAPO: the positive-example NLL), or None."""
        return None

    def _compute_loss(self, model, inputs):
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            frozen = self.in_critic_warmup()
            self._hold_policy(frozen)
            if self.args.critic_warmup_steps > 0:
                self._metrics["train"][self.warmup_metric].append(float(frozen))
            groups = self.optimizer.param_groups if self.optimizer is not None else []
            critic_lrs = [g["lr"] for g in groups if g.get(GROUP_ROLE) == "critic"]
            if critic_lrs:
                self._metrics["train"]["value/learning_rate"].append(critic_lrs[0])
        policy_loss = super()._compute_loss(model, inputs)  # TRL's loss, our KL term and dual-clip (base)
        logps, self._loss_logps = self._loss_logps, None

        mask = rollout.loss_mask(inputs)
        aggregate = functools.partial(self._aggregate, inputs)
        old = inputs.get("old_per_token_logps")
        old = logps.detach() if old is None else old
        extra = self.extra_policy_loss(logps, inputs, mask, aggregate)
        if extra is not None:
            policy_loss = policy_loss + extra
        self._metrics[mode]["approx_kl"].append(self._global_mean(0.5 * (logps.detach() - old) ** 2, mask))

        prompt_ids, completion_ids = inputs["prompt_ids"], inputs["completion_ids"]
        input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
        attention_mask = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
        with self.accelerator.autocast():
            # called as a submodule, not through the engine's forward (which would run the policy)
            values = critic_values(get_critic(model), input_ids, attention_mask, completion_ids.shape[1],
                                   image_fields=rollout.image_inputs(inputs))
        value_mask = inputs["value_mask"]
        per_token_vf, vf_clipped = clipped_value_loss(
            values, inputs["old_values"], inputs["returns"], self.args.cliprange_value
        )
        # the mean over the value targets (see the module docstring): token-level types divide by their count
        value_loss = aggregate(per_token_vf, value_mask, num_items_in_batch=inputs["num_value_tokens"])
        self._metrics[mode]["value/loss"].append(self._global_mean(per_token_vf, value_mask))
        self._metrics[mode]["value/clip_frac"].append(self._global_mean(vf_clipped.float(), value_mask))

        scale = self.policy_loss_scale() if mode == "train" else 1.0
        # scale 0 keeps the policy in the graph (exact zero gradients: DDP and ZeRO expect a gradient for every
        # parameter) while leaving it untouched
        return scale * policy_loss + self.args.vf_coef * value_loss

    # -------------------------------------------------------------------------------------------- save / load
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        self._exporting = not _internal_call or self._pushing
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self._exporting = False

    def push_to_hub(self, *args, **kwargs):
        # transformers' push saves with `_internal_call=True` (the checkpoint path): what goes to the Hub is an
        # export, the policy without `critic.*` keys and the critic in `value_model/` when `save_value_model`
        self._pushing = True
        try:
            return super().push_to_hub(*args, **kwargs)
        finally:
            self._pushing = False

    def _save(self, output_dir: str | None = None, state_dict=None):
        # Checkpoints too keep the critic out of the policy's weights (in `value_model/`): transformers pushes a
        # checkpoint's weight files as they are (`_push_from_checkpoint`, `hub_strategy="checkpoint"`), so every copy
        # of a checkpoint must already be the policy alone. Resume and the best model read the critic back from there.
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        critic_state = None
        if state_dict:  # gathered by DeepSpeed: split it; `{}` is DeepSpeed's dummy when it cannot gather
            state_dict, critic_state = split_critic_state_dict(state_dict)
        with detached_critic(self.model) as critic:
            super()._save(output_dir, state_dict=state_dict)
        if critic is None or (self._exporting and not self.args.save_value_model):
            return
        if state_dict == {} and not critic_state:
            return  # ZeRO-3 without 16-bit gathering: the critic is in DeepSpeed's own checkpoint files
        save_critic(critic, os.path.join(output_dir, VALUE_MODEL_DIR), state_dict=critic_state,
                    is_main_process=self.args.should_save)
        if self.args.should_save and self.processing_class is not None:  # so that value_model/ loads on its own
            self.processing_class.save_pretrained(os.path.join(output_dir, VALUE_MODEL_DIR))

    def _push_from_checkpoint(self, checkpoint_folder):
        # transformers copies the checkpoint's policy files into `output_dir` and uploads that folder: the critic of
        # the same step goes with them. Not while an earlier upload of `output_dir` may still be reading it (the
        # condition under which transformers skips this push).
        args = self.args
        source = os.path.join(checkpoint_folder, VALUE_MODEL_DIR)
        # `push_in_progress` exists on the main process only
        pushes = (self.is_world_process_zero() and args.hub_strategy != HubStrategy.END and (
            args.hub_always_push or self.push_in_progress is None or self.push_in_progress.is_done()))
        if pushes and args.save_value_model and os.path.isdir(source):
            target = os.path.join(args.output_dir, VALUE_MODEL_DIR)
            shutil.rmtree(target, ignore_errors=True)  # a LoRA critic's files and a full critic's differ
            shutil.copytree(source, target)
        super()._push_from_checkpoint(checkpoint_folder)

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        super()._load_from_checkpoint(resume_from_checkpoint, model)
        self._load_checkpoint_critic(resume_from_checkpoint)

    def _load_best_model(self):
        # transformers reloads the policy alone (a PEFT policy: its adapter alone); the exported `value_model/` must
        # be the same step's critic
        super()._load_best_model()
        if not self.is_deepspeed_enabled:  # DeepSpeed's engine checkpoint brought the critic back with the policy
            self._load_checkpoint_critic(self.state.best_model_checkpoint)

    def _load_checkpoint_critic(self, checkpoint: str) -> None:
        path = os.path.join(checkpoint, VALUE_MODEL_DIR)
        if not os.path.isdir(path):
            if not is_peft_model(self.model) and holds_critic_weights(checkpoint):
                return  # written when checkpoints kept `critic.*` in the policy's weights: loaded with them
            raise FileNotFoundError(f"{checkpoint} holds no critic ({VALUE_MODEL_DIR}/ is missing)")
        load_critic(self.critic, path)
        if hasattr(self.critic, "restore_trainable"):  # PEFT's adapter loading resets which adapter trains
            self.critic.restore_trainable()

    def _issue_warnings_after_load(self, load_result):
        # the policy's weights are loaded before the critic, which is never in them: not a missing key
        if hasattr(load_result, "_replace"):
            load_result = load_result._replace(
                missing_keys=[k for k in load_result.missing_keys if not is_critic_key(k)])
        super()._issue_warnings_after_load(load_result)


class PolicySyncRefModelCallback(SyncRefModelCallback):
    """TRL's `sync_ref_model` (`ref <- (1 - alpha) ref + alpha policy` every `ref_model_sync_steps`) from the policy's
    parameters alone: TRL's pairs every parameter of the model, whose critic the reference model does not have."""

    def on_step_end(self, args, state, control, **kwargs):
        if self.ref_model is None or state.global_step % args.ref_model_sync_steps != 0:
            return
        model = kwargs["model"]
        if self.accelerator:
            model = self.accelerator.unwrap_model(model)
        self.sync_target_model(_PolicyParameters(model), self.ref_model, args.ref_model_mixup_alpha)


class _PolicyParameters:
    """`model.parameters()` without the critic's (what `SyncRefModelCallback.sync_target_model` reads)."""

    def __init__(self, model):
        self.model = model

    def parameters(self):
        return [p for name, p in self.model.named_parameters() if not is_critic_key(name)]


def _innermost_optimizer(optimizer):
    """accelerate's wrapper / DeepSpeed's ZeRO optimizer -> the torch optimizer that holds the param groups."""
    while hasattr(optimizer, "optimizer") and hasattr(optimizer.optimizer, "param_groups"):
        optimizer = optimizer.optimizer
    return optimizer


__all__ = ["PPOConfig", "PPOTrainer"]
