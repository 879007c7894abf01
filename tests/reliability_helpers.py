"""Shared by the reliability tests (test_resume, test_faults, test_bad_rewards, test_config_errors).

`TRAINER_SPECS` lists every trainer of the package with the tiny settings the reliability tests run it with;
`available_specs()` keeps those whose module exists (the trainers land one by one).
"""

from __future__ import annotations

import importlib
import math

import torch
from transformers import TrainerCallback

# name -> (module, config class, trainer class, config overrides, whether addition_reward is passed)
TRAINER_SPECS = {
    # the package's GRPO (TRL's advantages, the package's fields and guards): the baseline `trl-ppo-variants grpo`
    "grpo": ("trl_ppo_variants.trainers.grpo", "GRPOConfig", "GRPOTrainer", {}, True),
    "rloo": ("trl_ppo_variants.trainers.rloo", "RLOOConfig", "RLOOTrainer", {}, True),
    "rloo_kl": ("trl_ppo_variants.trainers.rloo", "RLOOConfig", "RLOOTrainer", {"beta": 0.05}, True),
    "remax": ("trl_ppo_variants.trainers.remax", "ReMaxConfig", "ReMaxTrainer", {}, True),
    "reinforce_pp": ("trl_ppo_variants.trainers.reinforce_pp", "ReinforcePPConfig", "ReinforcePPTrainer",
                     {"kl_in_reward_coef": 0.01}, True),
    "reinforce_pp_baseline": ("trl_ppo_variants.trainers.reinforce_pp", "ReinforcePPConfig", "ReinforcePPTrainer",
                              {"baseline": True}, True),
    "dapo": ("trl_ppo_variants.trainers.dapo", "DAPOConfig", "DAPOTrainer", {"max_generation_rounds": 3}, True),
    "ppo": ("trl_ppo_variants.trainers.ppo", "PPOConfig", "PPOTrainer", {}, True),
    # the resume tests checkpoint at step 3 of 4: "vapo" resumes after its 2 value pre-training steps,
    # "vapo_pretrain" exactly at the end of 3 (a counter restarted on resume would pre-train again at step 4)
    "vapo": ("trl_ppo_variants.trainers.vapo", "VAPOConfig", "VAPOTrainer", {"value_pretrain_steps": 2}, True),
    "vapo_pretrain": ("trl_ppo_variants.trainers.vapo", "VAPOConfig", "VAPOTrainer", {"value_pretrain_steps": 3},
                      True),
    "ttrl": ("trl_ppo_variants.trainers.ttrl", "TTRLConfig", "TTRLTrainer", {"n_votes": 4, "n_train": 2}, False),
    # the digits task's per-digit step reward (steps split on ", ") besides addition_reward
    "process_grpo": ("trl_ppo_variants.trainers.process_grpo", "ProcessGRPOConfig", "ProcessGRPOTrainer",
                     {"step_separator": ", "}, True),
}


def trainer_kwargs(name) -> dict:
    """Trainer arguments of a spec besides the reward functions (the step reward functions of process GRPO)."""
    if name == "process_grpo":
        from trl_ppo_variants.toy import digit_step_rewards

        return {"step_reward_funcs": [digit_step_rewards]}
    return {}


def load_spec(name):
    module, config_name, trainer_name, overrides, with_reward = TRAINER_SPECS[name]
    mod = importlib.import_module(module)
    return getattr(mod, config_name), getattr(mod, trainer_name), dict(overrides), with_reward


def available_specs() -> list[str]:
    names = []
    for name in TRAINER_SPECS:
        try:
            load_spec(name)
        except (ImportError, AttributeError):
            continue
        names.append(name)
    return names


class StopAt(TrainerCallback):
    """Stop training after `step` optimizer steps (after that step's checkpoint is written): a run that "stops"."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.step:
            control.should_training_stop = True


def make_trainer(name, model_dir, tmp_path, out, reward=None, callbacks=None, dataset=None, eval_dataset=None,
                 **overrides):
    from conftest import toy_args

    from trl_ppo_variants.toy import addition_dataset, addition_reward

    config_cls, trainer_cls, spec_overrides, with_reward = load_spec(name)
    spec_overrides.update(overrides)
    args = toy_args(config_cls, tmp_path, output_dir=str(tmp_path / out), **spec_overrides)
    funcs = reward if reward is not None else (addition_reward if with_reward else None)
    return trainer_cls(model_dir, funcs, args=args, train_dataset=dataset or addition_dataset(64, seed=0),
                       eval_dataset=eval_dataset, callbacks=callbacks, **trainer_kwargs(name))


def modules_state(trainer) -> dict[str, torch.Tensor]:
    """Every trained weight: the policy (with a critic attached as a submodule) and a separate critic if any."""
    state = {f"model.{k}": v.detach().clone() for k, v in trainer.model.state_dict().items()}
    for attr in ("critic", "value_model"):
        module = getattr(trainer, attr, None)
        if isinstance(module, torch.nn.Module) and not any(module is m for m in trainer.model.modules()):
            state.update({f"{attr}.{k}": v.detach().clone() for k, v in module.state_dict().items()})
    return state


NON_REPRODUCIBLE_KEYS = ("time", "per_second", "runtime", "train_loss", "total_flos")


def step_logs(trainer) -> dict[int, dict]:
    """Logged training metrics by step, without wall-clock ones (and `train_loss`, the mean over one `train` call)."""
    out = {}
    for entry in trainer.state.log_history:
        if "step" not in entry or "train_runtime" in entry:
            continue
        metrics = {k: v for k, v in entry.items() if not any(s in k for s in NON_REPRODUCIBLE_KEYS)}
        out.setdefault(entry["step"], {}).update(metrics)
    return out


def is_finite_or_none(value) -> bool:
    return value is None or not isinstance(value, float) or math.isfinite(value)
