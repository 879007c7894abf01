"""Bad rewards are contained (issue 7, point 3), for every trainer of the package.

None/NaN/+-inf for some completions: the loss, the gradient norm and every logged metric stay finite, those
completions get advantage 0, and `rewards/<func>/non_finite` counts them. A function that raises or returns the wrong
number of rewards stops training with a one-line error naming the function and the batch, and the weights are those
of the last good step (no optimizer step on the bad batch).
"""

import math

import pytest
import torch
from reliability_helpers import available_specs, is_finite_or_none, make_trainer, modules_state
from transformers import TrainerCallback

from trl_ppo_variants.toy import addition_reward

BAD_VALUES = [None, float("nan"), float("inf"), float("-inf")]
# one configuration per trainer ("vapo_pretrain" differs from "vapo" only for the resume test)
NAMES = [n for n in available_specs() if n != "vapo_pretrain"]
# VAPO: one value pre-training step, so that the policy is trained at step 2; TTRL: the test rewards read the
# `answer` column, which TTRL refuses unless told (it is label-free)
OVERRIDES = {"vapo": {"value_pretrain_steps": 1}, "ttrl": {"allow_labelled_rewards": True}}
# one counted reward call per step of 8 completions (ReMax's second call, for its greedy rows, is not counted): the
# logged count is exactly 4; for the others (DAPO refills, TTRL votes) it is a mean over calls, and positive
ONE_CALL = {"grpo", "rloo", "rloo_kl", "remax", "reinforce_pp", "reinforce_pp_baseline", "ppo", "vapo",
            "process_grpo"}


def flaky_reward(completions, answer, **kwargs):
    """addition_reward, except completions 0-3 of every batch of 8 get None, NaN, +inf, -inf."""
    good = addition_reward(completions, answer)
    return [BAD_VALUES[i % 8] if i % 8 < 4 else r for i, r in enumerate(good)]


# TTRL's vote is its reward; the flaky function is added beside it
@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_non_finite_rewards_are_contained(name, toy_model_dir, tmp_path):
    trainer = make_trainer(name, toy_model_dir, tmp_path, "out", reward=[flaky_reward], max_steps=2,
                           **OVERRIDES.get(name, {}))
    trainer.train()
    history = [e for e in trainer.state.log_history if "loss" in e]
    assert len(history) == 2
    for entry in trainer.state.log_history:
        bad = {k: v for k, v in entry.items() if not is_finite_or_none(v)}
        assert not bad, f"non-finite logged metrics: {bad}"
    for entry in history:
        assert math.isfinite(entry["loss"]) and math.isfinite(entry["grad_norm"])
        count = entry["rewards/flaky_reward/non_finite"]
        assert count == 4 if name in ONE_CALL else count > 0
    for value in modules_state(trainer).values():
        assert torch.isfinite(value).all()
    # the completions table: every unscorable completion trained with advantage 0 (NaN = dropped by selection)
    rewards = list(trainer._logs["rewards"]["flaky_reward"])
    advantages = list(trainer._logs["advantages"])
    assert len(rewards) == len(advantages) and rewards
    unscorable = [a for r, a in zip(rewards, advantages) if not math.isfinite(r)]
    assert len(unscorable) >= 4
    # TTRL's vote scores every completion, and so does process GRPO's step reward function: a None from an extra
    # function does not make them unscorable
    if name not in ("ttrl", "process_grpo"):
        assert all(a == 0.0 or math.isnan(a) for a in unscorable), unscorable
    # +-inf was turned into NaN (unscorable) before anything saw it
    assert not any(math.isinf(r) for r in rewards)


class _Snapshot(TrainerCallback):
    def __init__(self):
        self.weights = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        self.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fails_at_step_1(kind):
    def broken_reward(completions, answer, trainer_state=None, **kwargs):
        rewards = addition_reward(completions, answer)
        if trainer_state.global_step < 1:
            return rewards
        if kind == "raises":
            raise ZeroDivisionError("division by zero\nin a multi-line message")
        return rewards[:-1]

    return broken_reward


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["raises", "wrong_length"])
@pytest.mark.parametrize("name", NAMES)
def test_broken_reward_function_stops_before_the_step(name, kind, toy_model_dir, tmp_path):
    snapshot = _Snapshot()
    trainer = make_trainer(name, toy_model_dir, tmp_path, "out", reward=[_fails_at_step_1(kind)], max_steps=3,
                           callbacks=[snapshot], **OVERRIDES.get(name, {}))
    expected = RuntimeError if kind == "raises" else ValueError
    with pytest.raises(expected) as err:
        trainer.train()
    message = str(err.value)
    assert "\n" not in message
    assert "'broken_reward'" in message and "global step 1" in message and "first prompt" in message
    assert ("ZeroDivisionError" in message) if kind == "raises" else ("rewards for" in message)
    assert trainer.state.global_step == 1
    current = trainer.model.state_dict()
    assert all(torch.equal(current[k], snapshot.weights[k]) for k in current), "an optimizer step used the batch"


def test_non_numbers_are_refused_in_one_line(toy_model_dir, tmp_path):
    def text_reward(completions, **kwargs):
        return ["1.0"] * len(completions)

    trainer = make_trainer("rloo", toy_model_dir, tmp_path, "out", reward=[text_reward], max_steps=1)
    with pytest.raises(ValueError, match=r"^reward function 'text_reward' returned a non-number '1.0'") as err:
        trainer.train()
    assert "\n" not in str(err.value)


# ------------------------------------------------------------------------------------------------ nothing scorable
def _nothing(completions, **kwargs):
    return [None] * len(completions)


def _nan_then_good(completions, answer, trainer_state=None, **kwargs):
    """NaN for every completion of steps 0-2, then addition_reward."""
    if trainer_state.global_step < 3:
        return [float("nan")] * len(completions)
    return addition_reward(completions, answer)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", NAMES)
def test_consecutive_unscorable_batches_stop_training(name, toy_model_dir, tmp_path):
    """A run whose rewards are all None ended "successfully" with loss 0 at every step. After
    `max_unscorable_batches` consecutive batches without one scorable completion, every trainer stops with one line
    (TTRL's vote and process GRPO's step rewards always score: they never stop; DAPO's overlong shaping does not
    count as a score)."""
    trainer = make_trainer(name, toy_model_dir, tmp_path, "out", reward=[_nothing], max_steps=6,
                           max_unscorable_batches=2, min_unscorable_prompts=4, **OVERRIDES.get(name, {}))
    if name in ("ttrl", "process_grpo"):
        trainer.train()
        assert trainer.state.global_step == 6
        return
    with pytest.raises(RuntimeError) as err:
        trainer.train()
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("no completion got a finite reward in 2 consecutive generation batches ("), message
    assert "'_nothing'" in message and "max_unscorable_batches=2" in message and "min_unscorable_prompts=4" in message
    assert trainer.state.global_step <= 2  # DAPO's refill rounds are batches too: it stops within its first step


def _none_on_steps_1_to_8(completions, answer, trainer_state=None, **kwargs):
    """None for every completion of global steps 1-8 (one prompt a batch: a prompt without a gold answer), else
    addition_reward."""
    if 1 <= trainer_state.global_step <= 8:
        return [None] * len(completions)
    return addition_reward(completions, answer)


@pytest.mark.timeout(300)
def test_a_run_of_unscorable_one_prompt_batches_does_not_stop_a_healthy_run(toy_model_dir, tmp_path):
    """Batches of one prompt: 8 unscorable batches in a row (8 prompts) are chance in a healthy run whose reward
    returns None for some prompts (TRL's accuracy_reward on a gold answer that does not parse), not a broken one. The
    defaults (5 batches, 32 prompts) keep training; 5 batches alone stopped it at step 6 of 12."""
    trainer = make_trainer("rloo", toy_model_dir, tmp_path, "out", reward=[_none_on_steps_1_to_8], max_steps=12,
                           per_device_train_batch_size=4)
    trainer.train()
    assert trainer.state.global_step == 12
    assert trainer.scoring_tally["unscorable_batches"] == 8 and trainer.scoring_tally["consecutive"] == 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("batch, stop", [(4, 32), (32, 5)])
def test_a_run_that_never_scores_stops_after_batches_and_prompts(batch, stop, toy_model_dir, tmp_path):
    """The fast failure stays: all-None rewards stop after max(5 batches, 32 prompts): 32 one-prompt batches, or 5
    batches of 8 prompts."""
    trainer = make_trainer("grpo", toy_model_dir, tmp_path, "out", reward=[_nothing], max_steps=40,
                           per_device_train_batch_size=batch, max_completion_length=2)
    with pytest.raises(RuntimeError) as err:
        trainer.train()
    prompts = stop * batch // 4
    assert str(err.value).startswith(f"no completion got a finite reward in {stop} consecutive generation batches "
                                     f"({prompts} prompts)"), str(err.value)
    assert trainer.state.global_step == stop - 1  # the stop comes before the step of the last batch


@pytest.mark.timeout(300)
def test_unscorable_batches_are_counted_and_partial_nan_trains(toy_model_dir, tmp_path):
    """Three unscorable batches, then good ones: the count resets, training goes on (the limit is 4); the tally says
    what happened. A run that never scored one completion fails at its end even below the limit; None disables."""
    trainer = make_trainer("rloo", toy_model_dir, tmp_path, "out", reward=[_nan_then_good], max_steps=5,
                           max_unscorable_batches=4)
    trainer.train()
    assert trainer.scoring_tally == {"batches": 5, "unscorable_batches": 3, "consecutive": 0,
                                     "consecutive_prompts": 0, "completions": 40, "unscorable_completions": 24}
    short = make_trainer("rloo", toy_model_dir, tmp_path, "short", reward=[_nothing], max_steps=2)  # limit 5
    with pytest.raises(RuntimeError, match=r"^no completion got a finite reward in any of the run's 2 generation "
                                           r"batches \(up to global step 2\)"):
        short.train()
    off = make_trainer("rloo", toy_model_dir, tmp_path, "off", reward=[_nothing], max_steps=3,
                       max_unscorable_batches=None)
    off.train()
    assert off.state.global_step == 3 and off.scoring_tally["unscorable_batches"] == 3


def test_a_failed_function_does_not_print_trl_none_warning(toy_model_dir, tmp_path, caplog):
    """TRL warns "All reward functions returned None ... ensure that at least one reward function returns a valid
    reward" for a row no function scored. When a function raised, that row holds our placeholders: the warning is
    untrue and came before our one-line error. A real all-None row still warns."""
    import logging

    def raises(completions, **kwargs):
        raise ValueError("boom")

    trainer = make_trainer("rloo", toy_model_dir, tmp_path, "out", reward=[raises], max_steps=1)
    with caplog.at_level(logging.WARNING, logger="trl.trainer.grpo_trainer"), pytest.raises(RuntimeError):
        trainer.train()
    assert not [r for r in caplog.records if "All reward functions returned None" in r.getMessage()]
    trainer = make_trainer("rloo", toy_model_dir, tmp_path, "none", reward=[_nothing], max_steps=1,
                           max_unscorable_batches=None)
    with caplog.at_level(logging.WARNING, logger="trl.trainer.grpo_trainer"):
        trainer.train()
    assert [r for r in caplog.records if "All reward functions returned None" in r.getMessage()]


def _nan_from_step_2(completions, answer, trainer_state=None, **kwargs):
    """addition_reward, NaN for every completion from global step 2 on."""
    if trainer_state.global_step >= 2:
        return [float("nan")] * len(completions)
    return addition_reward(completions, answer)


@pytest.mark.timeout(300)
def test_a_resumed_run_keeps_its_scoring_tally(toy_model_dir, tmp_path):
    """The tally belongs to the run: 3 steps whose last batch is unscorable complete with 1 of 3 batches unscored;
    stopped after step 2 and resumed, the same run raised "no completion got a finite reward in any of the run's 1
    generation batches" after training (the tally had restarted at the resume). It completes now, with the
    uninterrupted run's tally."""
    from reliability_helpers import StopAt

    common = dict(reward=[_nan_from_step_2], max_steps=3, save_strategy="steps", save_steps=2)
    full = make_trainer("rloo", toy_model_dir, tmp_path, "full", **common)
    full.train()
    assert full.scoring_tally["batches"] == 3 and full.scoring_tally["unscorable_batches"] == 1
    make_trainer("rloo", toy_model_dir, tmp_path, "stopped", callbacks=[StopAt(2)], **common).train()
    resumed = make_trainer("rloo", toy_model_dir, tmp_path, "stopped", **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 3
    assert resumed.scoring_tally == full.scoring_tally
