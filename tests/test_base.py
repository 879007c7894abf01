"""The seam into TRL (`trainers/base.py`): config errors at construction, reference loading for KL-in-reward, and the
selectable KL loss estimator."""

import pytest
import torch
from conftest import toy_args

from trl_ppo_variants.advantages import kl_estimate
from trl_ppo_variants.losses import aggregate_token_loss
from trl_ppo_variants.toy import addition_reward
from trl_ppo_variants.trainers.base import VariantConfig
from trl_ppo_variants.trainers.reinforce_pp import ReinforcePPConfig, ReinforcePPTrainer
from trl_ppo_variants.trainers.rloo import RLOOConfig, RLOOTrainer


def assert_config_error(config_cls, tmp_path, field, **overrides):
    with pytest.raises(ValueError) as info:
        toy_args(config_cls, tmp_path, **overrides)
    message = str(info.value)
    assert "\n" not in message, message
    assert message.startswith(f"{field}: expected "), message


@pytest.mark.parametrize(
    "config_cls, field, overrides",
    [
        (RLOOConfig, "num_generations", {"num_generations": 1, "per_device_train_batch_size": 8}),
        (VariantConfig, "num_generations", {"num_generations": 1}),
        (RLOOConfig, "beta", {"beta": -0.05}),
        (RLOOConfig, "num_generations_eval", {"num_generations_eval": 1}),
        (RLOOConfig, "kl_in_reward_coef", {"beta": 0.05, "kl_in_reward_coef": 0.2}),
        (RLOOConfig, "reward_clip_range", {"reward_clip_range": (1.0, -1.0)}),
        (VariantConfig, "beta", {"beta": -1.0}),
        (VariantConfig, "kl_in_reward_coef", {"kl_in_reward_coef": -0.01}),
        (VariantConfig, "kl_loss_estimator", {"kl_loss_estimator": "k4"}),
        (VariantConfig, "kl_in_reward_estimator", {"kl_in_reward_estimator": "kl"}),
        (VariantConfig, "temperature", {"temperature": 0.0}),
        (VariantConfig, "epsilon", {"epsilon": -0.2}),
        (VariantConfig, "epsilon_high", {"epsilon_high": -0.2}),
        (VariantConfig, "multi_objective_aggregation", {"multi_objective_aggregation": "normalize_then_sum"}),
        (ReinforcePPConfig, "kl_in_reward_coef", {"kl_in_reward_coef": -0.01, "beta": None}),
        (ReinforcePPConfig, "kl_in_reward_coef", {"baseline": True, "kl_in_reward_coef": 0.01, "beta": None}),
        (ReinforcePPConfig, "gamma", {"gamma": 0.0, "beta": None}),
        (ReinforcePPConfig, "gamma", {"gamma": 1.5, "beta": None}),
        (ReinforcePPConfig, "gamma", {"baseline": True, "gamma": 0.99, "beta": None}),
        (ReinforcePPConfig, "kl_loss_estimator", {"baseline": True, "kl_loss_estimator": "k5", "beta": None}),
        (ReinforcePPConfig, "beta", {"baseline": True, "beta": -1e-3}),
    ],
)
def test_config_errors_name_the_field(config_cls, field, overrides, tmp_path):
    assert_config_error(config_cls, tmp_path, field, **overrides)


def test_reinforce_pp_defaults_depend_on_the_variant(tmp_path):
    plain = toy_args(ReinforcePPConfig, tmp_path, beta=None)
    assert (plain.kl_in_reward_coef, plain.beta, plain.kl_loss_estimator) == (0.01, 0.0, "k3")
    base = toy_args(ReinforcePPConfig, tmp_path, beta=None, baseline=True)
    assert (base.kl_in_reward_coef, base.beta, base.kl_loss_estimator) == (0.0, 1e-3, "k2")
    assert not base.use_bias_correction_kl


def test_kl_in_reward_loads_reference_when_beta_is_zero(toy_model_dir, toy_dataset, tmp_path):
    args = toy_args(ReinforcePPConfig, tmp_path, beta=0.0, kl_in_reward_coef=0.05, bf16=False)
    trainer = ReinforcePPTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    assert trainer.ref_model is not None
    assert args.beta == 0.0 and trainer.loss_beta == 0.0  # the user's config is left as given
    trainer.model.train()
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions([toy_dataset[i] for i in range(2) for _ in range(4)])
    assert "ref_per_token_logps" in out and "kl_in_reward" not in out  # used for the advantages, not shipped
    # policy == reference at the start (the sampling log-probs come from `generate`: equal to float rounding)
    assert trainer._metrics["train"]["kl_in_reward"] == [pytest.approx(0.0, abs=1e-6)]
    trainer.current_gradient_accumulation_steps = 1
    trainer._compute_loss(trainer.model, out)
    assert "kl" not in trainer._metrics["train"]  # beta == 0: no KL loss term

    no_kl = toy_args(ReinforcePPConfig, tmp_path, beta=0.0, kl_in_reward_coef=0.0)
    assert ReinforcePPTrainer(toy_model_dir, addition_reward, args=no_kl, train_dataset=toy_dataset).ref_model is None


def test_rloo_beta_means_kl_in_reward(toy_model_dir, toy_dataset, tmp_path):
    args = toy_args(RLOOConfig, tmp_path, beta=0.05)
    trainer = RLOOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    assert trainer.ref_model is not None
    assert args.beta == 0.05 and trainer.kl_in_reward_coef == 0.05 and trainer.loss_beta == 0.0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("bias_correction", [False, True])
def test_k2_kl_loss_term(toy_model_dir, toy_dataset, tmp_path, bias_correction):
    """REINFORCE++-baseline's k2 KL loss: finite, equal to beta * the k2 estimate reduced like the policy loss, logged
    as "kl"; its gradient is the one of that term (with the importance weight's when `use_bias_correction_kl`)."""
    beta = 0.5
    args = toy_args(ReinforcePPConfig, tmp_path, baseline=True, beta=beta, use_bias_correction_kl=bias_correction)
    trainer = ReinforcePPTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    model = trainer.model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.train()
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([toy_dataset[i] for i in range(2) for _ in range(4)])
    trainer.current_gradient_accumulation_steps = 1
    mask = batch["completion_mask"]

    def loss_and_grad(loss_beta):
        trainer.loss_beta = loss_beta
        model.zero_grad()
        loss = trainer._compute_loss(model, batch)
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    with_kl, grad_with = loss_and_grad(beta)
    assert torch.isfinite(with_kl)
    logged = trainer._metrics["train"]["kl"]
    without, grad_without = loss_and_grad(0.0)
    trainer.loss_beta = beta

    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], mask], 1)
    model.zero_grad()
    logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, att, mask.shape[1])
    k2 = kl_estimate(logps, batch["ref_per_token_logps"], "k2")
    if bias_correction:  # on-policy the weight is 1 in value, but not in gradient
        k2 = k2 * torch.exp(logps - logps.detach())
    term = beta * aggregate_token_loss(k2, mask, "dapo", num_items_in_batch=batch["num_items_in_batch"])
    term.backward()
    torch.testing.assert_close(with_kl - without, term.detach(), rtol=1e-4, atol=1e-7)
    assert term.item() > 1e-5
    for g_with, g_without, p in zip(grad_with, grad_without, model.parameters()):
        torch.testing.assert_close(g_with - g_without, p.grad, rtol=1e-3, atol=1e-6)
    assert len(logged) == 1
    expected_logged = (kl_estimate(logps, batch["ref_per_token_logps"], "k2") * mask).sum() / mask.sum()
    assert logged[0] == pytest.approx(expected_logged.item(), rel=1e-4)
