"""Resume reproduces the uninterrupted run exactly, for every trainer of the package (issue 7, point 1).

Protocol: run A trains N=4 steps with a checkpoint every k=3 steps; run B trains the same configuration, stops after
step 3 (its checkpoint written), and a fresh trainer (fresh model object) resumes it with
`resume_from_checkpoint=True` and finishes. On CPU with a fixed seed every logged metric after the resume (losses,
rewards, advantages' statistics, KL, ...; not wall-clock times) and every final weight (policy and critic) must be
*equal*, with `steps_per_generation` 1 and 2 (with 2, step 3 is the first half of a generation block: the resumed run
must train step 4 on the buffered second half, not regenerate).

Exactness holds because nothing random is left to chance: the RNG states (transformers), the generation buffer and
its counter (checkpointing.py), the sampler's epoch order (checkpointing.resumable_sampler) and each trainer's own
state (`extra_state`) are restored, and CPU kernels are deterministic for a fixed thread count.
"""

import glob
import os

import pytest
import torch
from reliability_helpers import StopAt, available_specs, make_trainer, modules_state, step_logs

TOTAL, STOP = 4, 3


def _assert_same_run(full, resumed, after_step):
    logs_a, logs_b = step_logs(full), step_logs(resumed)
    compared = [s for s in logs_a if s > after_step]
    assert compared, "nothing was logged after the resume point"
    for step in compared:
        assert logs_b.get(step) == logs_a[step], f"step {step}: logs differ"
    wa, wb = modules_state(full), modules_state(resumed)
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ after resume: {different[:5]}"


def _full_and_resumed(name, toy_model_dir, tmp_path, **overrides):
    common = dict(max_steps=TOTAL, save_strategy="steps", save_steps=STOP, **overrides)
    full = make_trainer(name, toy_model_dir, tmp_path, "full", **common)
    full.train()
    stopped = make_trainer(name, toy_model_dir, tmp_path, "stopped", callbacks=[StopAt(STOP)], **common)
    stopped.train()
    assert stopped.state.global_step == STOP
    resumed = make_trainer(name, toy_model_dir, tmp_path, "stopped", **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == TOTAL
    return full, resumed


@pytest.mark.timeout(300)
@pytest.mark.parametrize("steps_per_generation", [1, 2])
@pytest.mark.parametrize("name", available_specs())
def test_resume_is_exact(name, steps_per_generation, toy_model_dir, tmp_path):
    full, resumed = _full_and_resumed(name, toy_model_dir, tmp_path, steps_per_generation=steps_per_generation)
    _assert_same_run(full, resumed, STOP)


@pytest.mark.timeout(300)
def test_resume_without_our_state_is_not_exact(toy_model_dir, tmp_path):
    """Negative control: the same protocol with the generation buffer file removed from the checkpoint (what TRL's
    GRPOTrainer saves) regenerates step 4's batch and ends elsewhere; so the exact test above can fail."""
    common = dict(max_steps=TOTAL, save_strategy="steps", save_steps=STOP, steps_per_generation=2)
    full = make_trainer("rloo", toy_model_dir, tmp_path, "full", **common)
    full.train()
    make_trainer("rloo", toy_model_dir, tmp_path, "stopped", callbacks=[StopAt(STOP)], **common).train()
    for path in glob.glob(str(tmp_path / "stopped" / "checkpoint-*" / "variant_state_rank*.pt")):
        os.remove(path)
    resumed = make_trainer("rloo", toy_model_dir, tmp_path, "stopped", **common)
    with pytest.warns(UserWarning, match="holds no generation buffer"):
        resumed.train(resume_from_checkpoint=True)
    wa, wb = modules_state(full), modules_state(resumed)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) > 1e-5


@pytest.mark.timeout(300)
def test_resume_in_a_later_epoch_is_exact(toy_model_dir, tmp_path):
    """8 prompts, 2 per step: 4 steps per epoch; checkpoint at step 5 (epoch 1). TRL's sampler would replay epoch 0's
    order after the resume (measured 5e-4 on the final weights); ours draws epoch 1's."""
    from trl_ppo_variants.toy import addition_dataset

    common = dict(max_steps=7, save_strategy="steps", save_steps=5, dataset=addition_dataset(8, seed=0))
    full = make_trainer("rloo", toy_model_dir, tmp_path, "full", **common)
    full.train()
    make_trainer("rloo", toy_model_dir, tmp_path, "stopped", callbacks=[StopAt(5)], **common).train()
    resumed = make_trainer("rloo", toy_model_dir, tmp_path, "stopped", **common)
    resumed.train(resume_from_checkpoint=True)
    _assert_same_run(full, resumed, 5)


def test_resumable_sampler_draws_trl_order():
    """Epoch e of our sampler = TRL's RepeatSampler's (e+1)-th pass, whatever passes came before."""
    from trl.trainer.utils import RepeatSampler

    from trl_ppo_variants.checkpointing import resumable_sampler

    class FakeTrainer:
        class state:
            epoch = 0.0

    trainer = FakeTrainer()
    data = list(range(10))
    trl_sampler = RepeatSampler(data, mini_repeat_count=2, batch_size=2, repeat_count=2, shuffle=True, seed=3)
    trl_passes = [list(trl_sampler) for _ in range(3)]
    ours = resumable_sampler(RepeatSampler(data, mini_repeat_count=2, batch_size=2, repeat_count=2, seed=3), trainer)
    for epoch in (2, 0, 1, 2):  # out of order: no dependence on earlier passes
        trainer.state.epoch = epoch + 0.5
        assert list(ours) == trl_passes[epoch]
    assert len(ours) == len(trl_sampler)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name, field", [("vapo", "value_pretrain_steps"), ("ppo", "critic_warmup_steps")])
def test_resume_during_critic_warmup_is_exact(name, field, toy_model_dir, tmp_path):
    """A checkpoint in the middle of the critic warm-up (VAPO's value pre-training; PPO's `critic_warmup_steps`, the
    same mechanism): step 3 of 4 warm-up steps, 6 in all, with the policy's warm-up schedule starting at step 4.
    The resumed run warms the critic up exactly one more step, then trains the policy on the same schedule, and ends
    equal to the uninterrupted run."""
    if name not in available_specs():
        pytest.fail(f"the {name} trainer is missing")
    common = dict(max_steps=6, save_strategy="steps", save_steps=STOP, warmup_steps=1, **{field: 4})
    full = make_trainer(name, toy_model_dir, tmp_path, "full", **common)
    full.train()
    stopped = make_trainer(name, toy_model_dir, tmp_path, "stopped", callbacks=[StopAt(STOP)], **common)
    stopped.train()
    assert stopped.state.global_step == STOP
    resumed = make_trainer(name, toy_model_dir, tmp_path, "stopped", **common)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 6
    _assert_same_run(full, resumed, STOP)
    # the rate each step ran with: steps 1-4 warm the critic up, step 5 is the policy's first (its own warm-up step)
    rates = [step_logs(resumed)[s]["learning_rate"] for s in range(4, 7)]
    assert rates == pytest.approx([0.0, 0.0, 1e-3])
