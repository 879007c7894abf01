"""Config mistakes are caught at construction, each with a one-line error naming the field (issue 7, point 5).

Every case builds the config (and, when the check needs the model, the trainer) and expects a `ValueError` whose
message is one line starting with `<field>: expected`. The table of the checks is in docs/reliability.md.
"""

from types import SimpleNamespace

import pytest
from reliability_helpers import TRAINER_SPECS, available_specs, load_spec, make_trainer

AVAILABLE = set(available_specs())

# (trainer spec, overrides, field named by the error)
CASES = [
    # batch shape (TRL's checks, restated in one line naming the field)
    ("rloo", {"per_device_train_batch_size": 6, "num_generations": 4}, "generation_batch_size"),
    ("rloo", {"generation_batch_size": 12}, "generation_batch_size"),
    ("rloo", {"generation_batch_size": 16, "steps_per_generation": 3}, "steps_per_generation"),
    ("rloo", {"num_generations": 1}, "num_generations"),
    ("rloo", {"do_eval": True, "eval_strategy": "steps", "per_device_eval_batch_size": 3},
     "per_device_eval_batch_size"),
    # clip ranges
    ("rloo", {"epsilon": 1.5}, "epsilon"),
    ("rloo", {"epsilon": -0.1}, "epsilon"),
    ("rloo", {"epsilon_high": -0.2}, "epsilon_high"),
    ("rloo", {"delta": 1.1}, "delta"),
    ("rloo", {"reward_clip_range": (1.0, -1.0)}, "reward_clip_range"),
    ("ppo", {"cliprange_value": -0.2}, "cliprange_value"),
    ("ppo", {"clip_ratio_c": 1.0}, "clip_ratio_c"),
    ("ppo", {"clip_ratio_c": 0.5}, "clip_ratio_c"),
    # negative coefficients
    ("rloo", {"beta": -0.05}, "beta"),
    ("reinforce_pp", {"kl_in_reward_coef": -0.01}, "kl_in_reward_coef"),
    ("reinforce_pp", {"beta": -1.0}, "beta"),
    ("ppo", {"vf_coef": -0.5}, "vf_coef"),
    ("vapo", {"positive_lm_coef": -0.1}, "positive_lm_coef"),
    # other ranges
    ("rloo", {"top_p": 0.0}, "top_p"),
    ("rloo", {"learning_rate": -1e-3}, "learning_rate"),
    ("rloo", {"num_iterations": 0}, "num_iterations"),
    ("rloo", {"temperature": 0.0}, "temperature"),
    ("rloo", {"max_unscorable_batches": 0}, "max_unscorable_batches"),
    ("grpo", {"min_unscorable_prompts": 0}, "min_unscorable_prompts"),
    ("grpo", {"kl_in_reward_coef": 0.1}, "kl_in_reward_coef"),
    ("ttrl", {"n_votes": 4, "n_train": 6}, "n_train"),
    ("dapo", {"max_generation_rounds": -1}, "max_generation_rounds"),
    ("dapo", {"keep_rate_init": 0.0}, "keep_rate_init"),
    ("dapo", {"keep_rate_smoothing": 1.5}, "keep_rate_smoothing"),
    ("dapo", {"shortfall_probability": 1.0}, "shortfall_probability"),
    ("dapo", {"max_oversample_factor": 0.5}, "max_oversample_factor"),
    ("rloo", {"sampling_logps_source": "vllm"}, "sampling_logps_source"),
    ("ppo", {"lam": 1.5}, "lam"),
    ("vapo", {"value_pretrain_steps": 5}, "value_pretrain_steps"),
    ("rloo", {"kl_loss_estimator": "k4"}, "kl_loss_estimator"),
    ("rloo", {"max_completion_length": 0}, "max_completion_length"),
    ("rloo", {"steps_per_generation": 0}, "steps_per_generation"),
    ("rloo", {"multi_objective_aggregation": "normalize_then_sum"}, "multi_objective_aggregation"),
    ("ppo", {"multi_objective_aggregation": "normalize_then_sum"}, "multi_objective_aggregation"),
    ("ttrl", {"multi_objective_aggregation": "normalize_then_sum", "kl_in_reward_coef": 0.1}, "kl_in_reward_coef"),
    # one sample per prompt: refused where the estimator needs a group
    ("dapo", {"num_generations": 1}, "num_generations"),
    ("reinforce_pp_baseline", {"num_generations": 1}, "num_generations"),
    # dual-clip only on a token-level PPO-clip loss
    ("rloo", {"clip_ratio_c": 3.0}, "loss_type"),
    ("remax", {"clip_ratio_c": 3.0, "loss_type": "cispo"}, "loss_type"),
    ("vapo", {"clip_ratio_c": 0.9}, "clip_ratio_c"),
    # critic warm-up: fewer steps than max_steps (2 here)
    ("ppo", {"critic_warmup_steps": 2}, "critic_warmup_steps"),
    # the per-step token normaliser needs whole optimizer steps inside a generation batch
    ("rloo", {"loss_type": "dapo", "gradient_accumulation_steps": 2, "steps_per_generation": 1},
     "steps_per_generation"),
    # needs the model: the toy model's context is 256 positions
    ("rloo", {"max_completion_length": 256}, "max_completion_length"),
    ("ppo", {"value_model_path": "/nonexistent/critic"}, "value_model_path"),
    # step rewards (process supervision)
    ("process_grpo", {"kl_in_reward_coef": 0.1}, "kl_in_reward_coef"),
    ("process_grpo", {"step_separator": ""}, "step_separator"),
    ("process_grpo", {"process_reward_model_style": "math-shepherd"}, "process_reward_model_style"),
    ("process_grpo", {"process_reward_model_step_tag": ""}, "process_reward_model_step_tag"),
    ("ppo", {"process_reward_model_path": "/nonexistent/prm"}, "process_reward_model_path"),
    ("reinforce_pp_baseline", {"process_reward_model_path": "."}, "process_reward_model_path"),
]


def _case_id(case):
    name, overrides, field = case
    return f"{name}-{field}-" + "-".join(f"{k}={v}" for k, v in overrides.items())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", [c for c in CASES if c[0] in AVAILABLE], ids=_case_id)
def test_config_error_is_one_line_naming_the_field(case, toy_model_dir, tmp_path):
    name, overrides, field = case
    with pytest.raises(ValueError) as err:
        make_trainer(name, toy_model_dir, tmp_path, "out", **overrides)
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"{field}: expected"), message


def test_zero3_with_vllm_needs_gathered_weights(tmp_path):
    """ZeRO-3 + vLLM + ds3_gather_for_generation=False: TRL documents the pair as incompatible. DeepSpeed cannot be
    initialised by plain pytest on CPU (no launcher), so the config's DeepSpeed plugin is stubbed."""
    from conftest import toy_args

    from trl_ppo_variants import guards

    config_cls = load_spec("rloo")[0]
    args = toy_args(config_cls, tmp_path, use_vllm=True, ds3_gather_for_generation=False)
    guards.check_config(args)  # no DeepSpeed: fine
    args.deepspeed_plugin = SimpleNamespace(zero_stage=2)
    guards.check_config(args)  # ZeRO-2 gathers nothing: fine
    args.deepspeed_plugin = SimpleNamespace(zero_stage=3)
    with pytest.raises(ValueError, match=r"^ds3_gather_for_generation: expected True with use_vllm=True") as err:
        guards.check_config(args)
    assert "\n" not in str(err.value)
    args.ds3_gather_for_generation = True
    guards.check_config(args)


def test_every_trainer_is_covered():
    """The table covers every algorithm of the package that exists (a new trainer must add its cases)."""
    algorithms = {TRAINER_SPECS[n][0] for n in AVAILABLE}
    covered = {TRAINER_SPECS[c[0]][0] for c in CASES if c[0] in AVAILABLE}
    assert {a for a in algorithms if "remax" not in a} <= covered  # ReMax adds no numeric field


#: (trainer spec, field, value): fields of TRL's GRPOConfig whose values TRL 1.16 checks late (at the first step, or
#: never) or raw (a TypeError); ours refuse them at construction. The valid values are those TRL's GRPOTrainer
#: branches on. (REINFORCE++ takes None for `beta` and `kl_in_reward_coef`: its defaults.)
TRL_FIELD_CASES = [
    ("rloo", "beta", None),
    ("ppo", "beta", None),
    ("ppo", "kl_in_reward_coef", None),
    ("remax", "kl_in_reward_coef", None),
    ("grpo", "loss_type", "ppo"),
    ("grpo", "scale_rewards", "std"),
    ("grpo", "scale_rewards", "true"),  # a string, as a command line gives it: not TRL's True
    ("grpo", "importance_sampling_level", "tokens"),
    ("grpo", "vllm_importance_sampling_mode", "token"),
    ("grpo", "top_entropy_quantile", 1.5),
    ("grpo", "top_entropy_quantile", -0.1),
]


@pytest.mark.parametrize("name, field, value", TRL_FIELD_CASES,
                         ids=[f"{n}-{f}={v!r}" for n, f, v in TRL_FIELD_CASES])
def test_trl_field_values_are_refused_at_construction(name, field, value, tmp_path):
    from conftest import toy_args

    with pytest.raises(ValueError) as err:
        toy_args(load_spec(name)[0], tmp_path, **{field: value})
    message = str(err.value)
    assert "\n" not in message, message
    assert message.startswith(f"{field}: expected") and message.endswith(f"got {value!r}"), message


def test_every_value_trl_accepts_still_constructs(tmp_path):
    from conftest import toy_args

    from trl_ppo_variants.losses import LOSS_TYPES
    from trl_ppo_variants.trainers.grpo import GRPOConfig

    valid = [("loss_type", v) for v in LOSS_TYPES] + [("scale_rewards", v) for v in ("group", "batch", "none")]
    valid += [("scale_rewards", True), ("scale_rewards", False), ("importance_sampling_level", "sequence"),
              ("top_entropy_quantile", 0.0), ("top_entropy_quantile", 0.2), ("beta", 0.1)]
    valid += [("vllm_importance_sampling_mode", v)
              for v in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")]
    for field, value in valid:
        toy_args(GRPOConfig, tmp_path, **{field: value})
    assert toy_args(GRPOConfig, tmp_path, scale_rewards=False).scale_rewards == "none"  # TRL's own mapping


#: one trainer spec per config class (several specs share one: rloo and rloo_kl, ...)
ONE_SPEC_PER_CONFIG = sorted({load_spec(n)[0]: n for n in sorted(AVAILABLE, reverse=True)}.values())


@pytest.mark.parametrize("spec", ONE_SPEC_PER_CONFIG)
def test_none_in_any_numeric_field_is_a_one_line_error(spec, tmp_path):
    """Every field declared as a plain `int` / `float` (the package's and TRL's), set to None (a YAML `~`, a value
    forgotten on a command line), is refused at construction naming the field, by every config class: before this
    check, 17 of them raised a raw TypeError from a comparison (`vf_coef`, `lam`, `keep_rate_init`, ...) and others
    were accepted, to fail at the first step."""
    from conftest import toy_args

    from trl_ppo_variants.trainers.base import numeric_field_types

    config_cls, _, overrides, _ = load_spec(spec)
    fields = numeric_field_types(config_cls)
    assert {"learning_rate", "temperature", "epsilon"} <= set(fields)  # TRL's fields are covered too
    wrong = {}
    for name in fields:
        try:
            toy_args(config_cls, tmp_path, **{**overrides, name: None})
        except ValueError as err:
            if not (str(err).startswith(f"{name}: expected") and "\n" not in str(err)):
                wrong[name] = str(err)
        except Exception as err:  # noqa: BLE001 - what the test is about: any other error is a failure
            wrong[name] = f"{type(err).__name__}: {err}"
        else:
            wrong[name] = "accepted"
    assert not wrong, wrong


def test_optional_numbers_take_none_after_a_command_line_was_parsed(tmp_path):
    """transformers' `HfArgumentParser` (the CLI's, TRL's) rewrites a dataclass field's `type` in place (`int | None`
    becomes `int`): the numeric check reads the classes' annotations, so `max_unscorable_batches=None` (documented:
    never stop) is still accepted after a parser was built in the same process."""
    from conftest import toy_args
    from transformers import HfArgumentParser

    config_cls = load_spec("dapo")[0]
    HfArgumentParser(config_cls)
    assert toy_args(config_cls, tmp_path, max_unscorable_batches=None).max_unscorable_batches is None
