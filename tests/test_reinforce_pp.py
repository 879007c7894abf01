"""REINFORCE++ and REINFORCE++-baseline: the advantages the trainer ships equal the pure functions on the same
rewards, masks and (independently recomputed) KL; the paper's one sample per prompt; and both variants learn the toy
task."""

import pytest
import torch
from conftest import assert_finite_logs, perturb, toy_args
from test_rloo import reward_curve

from trl_ppo_variants.advantages import kl_estimate, reinforce_pp_advantages, reinforce_pp_baseline_advantages
from trl_ppo_variants.toy import addition_reward
from trl_ppo_variants.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer


def scored_batch(trainer, toy_dataset, num_prompts=4, group_size=4, seed=1):
    trainer.model.train()
    torch.manual_seed(seed)
    out = trainer._generate_and_score_completions(
        [toy_dataset[i] for i in range(num_prompts) for _ in range(group_size)]
    )
    rewards = trainer._captured_rewards_per_func.sum(dim=1)  # one reward function, weight 1
    return out, rewards


def logged_advantages(trainer, n):
    return torch.tensor(list(trainer._logs["advantages"])[-n:])


@pytest.mark.timeout(120)
def test_reinforce_pp_batch_advantages_equal_pure_function(toy_model_dir, toy_dataset, tmp_path):
    coef = 0.05
    # fp32: the KL takes the log-probs recorded by `generate` (fp32), compared here with a forward pass (bf16 under
    # TRL's default autocast, 1e-2 apart)
    args = toy_args(ReinforcePPConfig, tmp_path, beta=None, kl_in_reward_coef=coef, per_device_train_batch_size=16,
                    bf16=False)
    trainer = ReinforcePPTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    perturb(trainer.model, seed=0, scale=0.05)  # KL(policy || reference) != 0
    out, rewards = scored_batch(trainer, toy_dataset)
    mask = out["completion_mask"]
    assert (mask.sum(1) != mask.sum(1)[0]).any(), "want ragged completions"
    assert 0 < rewards.mean() < 1, "want reward variance"

    # the KL recomputed here from both models, not taken from the trainer
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], 1)
    att = torch.cat([out["prompt_mask"], mask], 1)
    with torch.no_grad():
        logps = trainer._get_per_token_logps_and_entropies(trainer.model, ids, att, mask.shape[1])[0]
        ref = trainer._get_per_token_logps_and_entropies(trainer.ref_model, ids, att, mask.shape[1])[0]
    kl = kl_estimate(logps, ref, "k1") * mask
    assert (kl.abs() * mask).sum() > 1e-2
    expected = reinforce_pp_advantages(rewards, mask, kl=kl, kl_coef=coef, gamma=1.0)
    assert out["advantages"].shape == mask.shape
    torch.testing.assert_close(out["advantages"], expected, rtol=1e-4, atol=1e-5)
    # without the KL they would differ: the KL is really in the reward
    assert (reinforce_pp_advantages(rewards, mask) - expected).abs().max() > 1e-3
    # logged: the per-sequence mean of the token advantages over valid tokens
    per_row = (expected * mask).sum(1) / mask.sum(1)
    torch.testing.assert_close(logged_advantages(trainer, 16), per_row, rtol=1e-4, atol=1e-5)


@pytest.mark.timeout(120)
def test_reinforce_pp_baseline_batch_advantages_equal_pure_function(toy_model_dir, toy_dataset, tmp_path):
    args = toy_args(ReinforcePPConfig, tmp_path, baseline=True, beta=None, per_device_train_batch_size=16)
    trainer = ReinforcePPTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    out, rewards = scored_batch(trainer, toy_dataset)
    mask = out["completion_mask"]
    expected = reinforce_pp_baseline_advantages(rewards, mask, 4)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(out["advantages"], expected, rtol=1e-5, atol=1e-6)
    assert "ref_per_token_logps" in out  # for the k2 loss term (beta = 1e-3 by default)


@pytest.mark.timeout(180)
def test_one_sample_per_prompt_trains_and_evaluates(toy_model_dir, tmp_path):
    """The paper's setting (arXiv 2501.03262: one response per prompt, the baseline is the batch whitening):
    `num_generations=1` trains and evaluates, every step estimates advantages on groups of one, the logs are finite
    and hold no `frac_reward_zero_std` (always 1 for groups of one), `reward_std` is the batch's."""
    from trl_ppo_variants.toy import addition_dataset

    args = toy_args(ReinforcePPConfig, tmp_path, beta=None, num_generations=1, per_device_train_batch_size=4,
                    per_device_eval_batch_size=4, max_steps=3, eval_strategy="steps", eval_steps=3, temperature=1.5)
    trainer = ReinforcePPTrainer(toy_model_dir, addition_reward, args=args, train_dataset=addition_dataset(64),
                                 eval_dataset=addition_dataset(8, seed=1))
    seen = []
    estimate = trainer.compute_advantages
    trainer.compute_advantages = lambda r, b, g: seen.append((trainer.model.training, g, r.shape[0])) or estimate(
        r, b, g)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    trainer.train()
    assert seen == [(True, 1, 4)] * 3 + [(False, 1, 4)] * 2
    logs = trainer.state.log_history
    assert_finite_logs(logs)
    assert not any("frac_reward_zero_std" in key for entry in logs for key in entry)
    assert sum("reward_std" in h for h in logs) == 3 and sum("eval_reward_std" in h for h in logs) == 1
    assert any(not torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))


@pytest.mark.timeout(240)
@pytest.mark.parametrize("baseline", [False, True], ids=["reinforce_pp", "reinforce_pp_baseline"])
def test_reinforce_pp_learns(toy_model_dir, tmp_path, baseline):
    """60 steps x 32 completions, lr 1e-3, default KL settings of each variant: mean reward over the last 12 steps
    >= first 12 + 0.1 (seed 0; measured margins over seeds 0-2: +0.21 to +0.29 and +0.19 to +0.23)."""
    rewards = reward_curve(ReinforcePPTrainer, ReinforcePPConfig, toy_model_dir, tmp_path, beta=None,
                           baseline=baseline)
    first, last = sum(rewards[:12]) / 12, sum(rewards[-12:]) / 12
    assert last >= first + 0.1, (first, last)


@pytest.mark.timeout(120)
def test_only_the_entries_advantages_read_are_gathered(toy_model_dir, toy_dataset, tmp_path, monkeypatch):
    """The global batch holds masks, KL and values, never ids or log-probs: gathering those would cost every process
    the whole rollout's memory."""
    from trl_ppo_variants import rollout

    gathered = []
    original = rollout.gather_rollout
    monkeypatch.setattr(rollout, "gather_rollout",
                        lambda acc, output, *a: gathered.append(sorted(output)) or original(acc, output, *a))
    args = toy_args(ReinforcePPConfig, tmp_path, beta=None, kl_in_reward_coef=0.05, per_device_train_batch_size=16)
    trainer = ReinforcePPTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    out, _ = scored_batch(trainer, toy_dataset)
    assert gathered == [["completion_mask", "kl_in_reward"]]
    assert "completion_ids" in out and out["advantages"].shape == out["completion_mask"].shape  # the local batch
