"""RLOO against TRL: `grpo_advantages` == `trl.GRPOTrainer`'s advantages; our `RLOOTrainer` == `trl.RLOOTrainer`
(advantages, gradient, loss); and a learning test on the toy task."""

import pytest
import torch
import trl
from conftest import logged_rewards, perturb, toy_args

from trl_ppo_variants.advantages import grpo_advantages, rloo_advantages
from trl_ppo_variants.toy import addition_reward
from trl_ppo_variants.trainers.rloo import RLOOConfig, RLOOTrainer

NAN = float("nan")


def grads(model):
    return [p.grad.clone() for p in model.parameters()]


# --------------------------------------------------------------------------------------------- (a) GRPO
# Two reward functions with fixed outputs (weights 1 and 0.5) over 3 prompts x 4 completions: a spread group, an
# all-equal group, and a group with two unscorable rows (both functions return None) and one partially scored row.
F1 = [1.0, 0.0, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0, None, 0.3, None, 0.7]
F2 = [0.0, 1.0, 0.0, None, 0.0, 0.0, 0.0, 0.0, None, None, None, 1.0]
TOTAL = [1.0, 0.5, 0.5, 1.0, 2.0, 2.0, 2.0, 2.0, NAN, 0.3, NAN, 1.2]  # weighted nansum, NaN when all None


def scripted_f1(completions, **kwargs):
    return list(F1)


def scripted_f2(completions, **kwargs):
    return list(F2)


@pytest.mark.timeout(120)
def test_grpo_advantages_equal_trl_grpo_trainer(toy_model_dir, toy_dataset, tmp_path):
    """TRL's `_generate_and_score_completions` on a 12-row batch, for each `scale_rewards`, gives exactly (bitwise)
    the advantages of `grpo_advantages` on the weighted total reward."""
    args = toy_args(trl.GRPOConfig, tmp_path, per_device_train_batch_size=12, reward_weights=[1.0, 0.5])
    trainer = trl.GRPOTrainer(toy_model_dir, [scripted_f1, scripted_f2], args=args, train_dataset=toy_dataset)
    trainer.model.train()
    inputs = [toy_dataset[i] for i in range(3) for _ in range(4)]
    rewards = torch.tensor(TOTAL)
    for scale in ("group", "batch", "none"):
        trainer.scale_rewards = scale  # read by TRL at scoring time
        out = trainer._generate_and_score_completions([dict(x) for x in inputs])
        expected = grpo_advantages(rewards, 4, scale=scale)
        assert torch.equal(out["advantages"], expected), (scale, out["advantages"], expected)
        assert list(trainer._logs["advantages"])[-12:] == expected.tolist()
        assert expected[8] == 0 and expected[10] == 0 and (expected[4:8] == 0).all()


# --------------------------------------------------------------------------------------------- (b) TRL's RLOO
def make_pair(toy_model_dir, toy_dataset, tmp_path, **overrides):
    # fp32: our KL takes the log-probs recorded by `generate` (fp32), TRL's a forward pass (bf16 under its default
    # autocast, 1e-2 apart); in fp32 both are the same numbers
    common = dict(beta=0.05, bf16=False, **overrides)
    ours = RLOOTrainer(toy_model_dir, addition_reward, args=toy_args(RLOOConfig, tmp_path / "ours", **common),
                       train_dataset=toy_dataset)
    theirs = trl.RLOOTrainer(toy_model_dir, addition_reward,
                             args=toy_args(trl.RLOOConfig, tmp_path / "theirs", **common), train_dataset=toy_dataset)
    for trainer in (ours, theirs):
        perturb(trainer.model, seed=0, scale=0.05)  # the policy moves away from the reference: KL != 0
        trainer.model.train()
        trainer.current_gradient_accumulation_steps = 1
    return ours, theirs


def same_batch(ours, theirs, toy_dataset, seed=1):
    inputs = [toy_dataset[i] for i in range(2) for _ in range(4)]
    torch.manual_seed(seed)
    a = ours._generate_and_score_completions([dict(x) for x in inputs])
    torch.manual_seed(seed)
    b = theirs._generate_and_score_completions([dict(x) for x in inputs])
    assert torch.equal(a["completion_ids"], b["completion_ids"]), "both trainers must sample the same completions"
    return a, b


@pytest.mark.timeout(180)
@pytest.mark.parametrize("extra", [{}, {"normalize_advantages": True, "reward_clip_range": (0.0, 0.5)}],
                         ids=["default", "normalized-clipped"])
def test_rloo_matches_trl_rloo_on_policy(toy_model_dir, toy_dataset, tmp_path, extra):
    """Same seed, same model, same batch, `beta=0.05` (KL in the reward, k1 summed over tokens, with the policy moved
    away from the reference so that the KL matters), completions of up to 4 tokens:

    - advantages: equal (also with `normalize_advantages` and `reward_clip_range`);
    - gradient: equal. This needs our RLOOConfig defaults `loss_type="luspo"`, `importance_sampling_level="sequence"`
      (each sequence's loss summed over its tokens, one ratio per sequence), which are what make the on-policy
      gradient `-1/N sum_i A_i grad log pi(y_i)` identical to TRL's sequence-ratio loss;
    - loss value: not equal, by construction, and both are what they should be: TRL's is `-mean_i A_i` (0 up to
      rounding, leave-one-out advantages sum to 0 per group), ours `-mean_i |y_i| A_i`.
    """
    ours, theirs = make_pair(toy_model_dir, toy_dataset, tmp_path, **extra)
    a, b = same_batch(ours, theirs, toy_dataset)
    torch.testing.assert_close(a["advantages"], b["advantages"], rtol=1e-5, atol=1e-6)
    if not extra:  # the KL is in there: the advantages are not those of the raw rewards
        raw = rloo_advantages(ours.total_rewards(ours._captured_rewards_per_func), 4)
        assert (a["advantages"] - raw).abs().max() > 1e-3
        assert ours._metrics["train"]["kl_in_reward"][-1] == pytest.approx(
            theirs._metrics["train"]["kl"][-1], rel=1e-5)

    loss_ours = ours._compute_loss(ours.model, a)
    loss_ours.backward()
    loss_theirs = theirs._compute_loss(theirs.model, b)
    loss_theirs.backward()
    for g_ours, g_theirs in zip(grads(ours.model), grads(theirs.model)):
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-4, atol=1e-6)
    lengths = a["completion_mask"].sum(1).float()
    assert loss_theirs.item() == pytest.approx(-b["advantages"].mean().item(), abs=1e-5)
    assert loss_ours.item() == pytest.approx(-(lengths * a["advantages"]).mean().item(), abs=1e-5)


@pytest.mark.timeout(180)
def test_rloo_matches_trl_rloo_loss_off_policy_single_token(toy_model_dir, toy_dataset, tmp_path):
    """Off-policy (`num_iterations=2`, the policy moved after sampling, some ratios clipped) and single-token
    completions (`max_completion_length=1`): TRL's sequence ratio and ours coincide, so loss *values* and gradients
    are equal. With longer completions they differ off-policy by design (see `RLOOConfig`)."""
    ours, theirs = make_pair(toy_model_dir, toy_dataset, tmp_path, max_completion_length=1, num_iterations=2)
    a, b = same_batch(ours, theirs, toy_dataset)
    assert "old_per_token_logps" in a
    torch.testing.assert_close(a["advantages"], b["advantages"], rtol=1e-5, atol=1e-6)
    for trainer in (ours, theirs):
        perturb(trainer.model, seed=5, scale=0.05)  # an optimizer step's worth of change
    loss_ours = ours._compute_loss(ours.model, a)
    loss_ours.backward()
    loss_theirs = theirs._compute_loss(theirs.model, b)
    loss_theirs.backward()
    assert abs(loss_theirs.item()) > 1e-3
    torch.testing.assert_close(loss_ours, loss_theirs, rtol=1e-5, atol=1e-6)
    for g_ours, g_theirs in zip(grads(ours.model), grads(theirs.model)):
        torch.testing.assert_close(g_ours, g_theirs, rtol=1e-4, atol=1e-6)
    assert theirs._metrics["train"]["clip_ratio/region_mean"][-1] > 0  # the clipped branch is exercised
    assert ours._metrics["train"]["clip_ratio/region_mean"][-1] == theirs._metrics["train"]["clip_ratio/region_mean"][-1]


# --------------------------------------------------------------------------------------------- (c) learning
def reward_curve(trainer_cls, config_cls, toy_model_dir, tmp_path, **overrides):
    from trl_ppo_variants.toy import addition_dataset

    settings = dict(per_device_train_batch_size=32, max_steps=60, learning_rate=1e-3, lr_scheduler_type="constant")
    settings.update(overrides)
    args = toy_args(config_cls, tmp_path, **settings)
    trainer = trainer_cls(toy_model_dir, addition_reward, args=args, train_dataset=addition_dataset(2048, seed=0))
    trainer.train()
    return logged_rewards(trainer)


def test_evaluation_with_one_generation_per_prompt(toy_model_dir, toy_dataset, tmp_path):
    """Issue 20: `num_generations_eval=1` works as with trl.GRPOTrainer: evaluation trains nothing, and a completion
    without siblings has no leave-one-out baseline, so its advantage is 0 (training still needs G >= 2)."""
    args = toy_args(RLOOConfig, tmp_path, num_generations_eval=1, per_device_eval_batch_size=4, eval_strategy="steps",
                    eval_steps=1, max_steps=1)
    trainer = RLOOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset,
                          eval_dataset=toy_dataset.select(range(8)))
    seen = []
    estimate = trainer.compute_advantages

    def spy(rewards, batch, group_size):
        out = estimate(rewards, batch, group_size)
        seen.append((trainer.model.training, group_size, out.clone()))
        return out

    trainer.compute_advantages = spy
    trainer.train()
    evals = [advantages for training, group_size, advantages in seen if not training and group_size == 1]
    assert evals and all(torch.equal(a, torch.zeros_like(a)) for a in evals)
    assert any(training and group_size == 4 for training, group_size, _ in seen)
    assert any("eval_loss" in h for h in trainer.state.log_history)
    assert torch.equal(trainer.compute_advantages(torch.tensor([1.0, NAN]), None, 1), torch.zeros(2))


@pytest.mark.timeout(240)
def test_rloo_learns(toy_model_dir, tmp_path):
    """60 steps x 32 completions, lr 1e-3: mean reward over the last 12 steps >= first 12 + 0.1 (seed 0; measured
    margins over seeds 0-2: +0.19 to +0.24)."""
    rewards = reward_curve(RLOOTrainer, RLOOConfig, toy_model_dir, tmp_path, beta=0.05)
    first, last = sum(rewards[:12]) / 12, sum(rewards[-12:]) / 12
    assert last >= first + 0.1, (first, last)
