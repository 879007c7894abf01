"""`aggregate_token_loss`: hand-computed reductions, and agreement with how TRL's `GRPOTrainer` reduces its loss.

The second test is the one that matters: an extra per-token term (our KL loss) reduced with `aggregate_token_loss`
must weigh exactly what TRL's own loss would give it had TRL added it to `per_token_loss`. TRL adds `beta * k3`
inside its loss, so `loss(beta) - loss(0)` isolates TRL's reduction of `beta * k3` for every `loss_type`.
"""

import pytest
import torch
from conftest import toy_args

from trl_ppo_variants.losses import LOSS_TYPES, aggregate_token_loss

PER_TOKEN = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])


@pytest.mark.parametrize(
    "loss_type, kwargs, expected",
    [
        ("grpo", {}, (1.5 + 4.0) / 2),  # mean over sequences of each sequence's token mean
        ("sapo", {"grad_accum": 2}, (1.5 + 4.0) / 2 / 2),
        ("bnpo", {}, 7 / 3),  # token mean of the local batch
        ("bnpo", {"grad_accum": 2}, 7 / 3 / 2),
        ("dr_grpo", {"max_completion_length": 4}, 7 / (2 * 4)),
        ("luspo", {}, (3.0 + 4.0) / 2),  # mean over sequences of each sequence's token sum
        ("luspo", {"grad_accum": 2}, (3.0 + 4.0) / 2 / 2),
        # global token count 6 over 2 processes, 3 micro-batches per generation, 3 accumulation steps: 6/2*3/3 = 3
        ("dapo", {"num_items_in_batch": 6, "num_processes": 2, "grad_accum": 3, "steps_per_generation": 3}, 7 / 3),
        ("cispo", {"num_items_in_batch": 12, "num_processes": 2, "grad_accum": 1, "steps_per_generation": 2}, 7 / 3),
        ("vespo", {"num_items_in_batch": torch.tensor(3)}, 7 / 3),
    ],
)
def test_reductions_hand_computed(loss_type, kwargs, expected):
    out = aggregate_token_loss(PER_TOKEN, MASK, loss_type, **kwargs)
    assert out.shape == ()
    assert out.item() == pytest.approx(expected, rel=1e-6)


def test_masked_positions_do_not_count():
    garbage = PER_TOKEN.clone()
    garbage[MASK == 0] = 1e6
    for loss_type in ("grpo", "bnpo", "luspo"):
        assert aggregate_token_loss(garbage, MASK, loss_type) == aggregate_token_loss(PER_TOKEN, MASK, loss_type)


def test_errors():
    with pytest.raises(ValueError, match="needs max_completion_length"):
        aggregate_token_loss(PER_TOKEN, MASK, "dr_grpo")
    with pytest.raises(ValueError, match="needs num_items_in_batch"):
        aggregate_token_loss(PER_TOKEN, MASK, "dapo")
    with pytest.raises(ValueError, match="loss_type must be one of"):
        aggregate_token_loss(PER_TOKEN, MASK, "ppo")


@pytest.mark.timeout(120)
def test_matches_trl_reduction_for_every_loss_type(toy_model_dir, toy_dataset, tmp_path):
    """loss(beta) - loss(0) in TRL's `_compute_loss` == beta * aggregate_token_loss(k3) for each loss type."""
    from trl import GRPOConfig, GRPOTrainer

    from trl_ppo_variants.advantages import kl_estimate
    from trl_ppo_variants.toy import addition_reward

    beta = 0.3
    args = toy_args(GRPOConfig, tmp_path, beta=beta, gradient_accumulation_steps=2, use_bias_correction_kl=False)
    trainer = GRPOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    model = trainer.model
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():  # move the policy away from the reference so that the KL is not 0
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    model.train()
    inputs = [toy_dataset[i] for i in range(4) for _ in range(4)]  # 16 rows = 8 per step x 2 steps per generation
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions(inputs)
    trainer.current_gradient_accumulation_steps = 2
    mask = batch["completion_mask"]
    assert (mask.sum(1) != mask.sum(1)[0]).any(), "want ragged completions for this check"
    with torch.no_grad():
        ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
        att = torch.cat([batch["prompt_mask"], mask], 1)
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, att, mask.shape[1])
    k3 = kl_estimate(logps, batch["ref_per_token_logps"], "k3")
    assert (k3 * mask).sum() > 1e-3
    for loss_type in LOSS_TYPES:
        trainer.loss_type = loss_type
        with torch.no_grad():
            trainer.beta = beta
            with_kl = trainer._compute_loss(model, batch)
            trainer.beta = 0.0
            without = trainer._compute_loss(model, batch)
        ours = beta * aggregate_token_loss(
            k3, mask, loss_type, num_items_in_batch=batch["num_items_in_batch"], num_processes=1, grad_accum=2,
            steps_per_generation=args.steps_per_generation, max_completion_length=args.max_completion_length,
        )
        torch.testing.assert_close(with_kl - without, ours, rtol=1e-4, atol=1e-6, msg=loss_type)
