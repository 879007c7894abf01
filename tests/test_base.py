"""The seam into TRL (`trainers/base.py`): config errors at construction, reference loading for KL-in-reward, the
selectable KL loss estimator, dual-clip for every PPO-clip loss, GDPO's aggregation as TRL computes it, and the
token-level normaliser of each optimizer step."""

import pytest
import torch
from conftest import toy_args

from trl_ppo_variants.advantages import kl_estimate
from trl_ppo_variants.losses import aggregate_token_loss
from trl_ppo_variants.toy import addition_reward
from trl_ppo_variants.trainers.base import VariantConfig
from trl_ppo_variants.trainers.dapo import DAPOConfig
from trl_ppo_variants.trainers.remax import ReMaxConfig
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
        # one sample per prompt: only the estimators without a group baseline accept it
        (ReinforcePPConfig, "num_generations", {"baseline": True, "num_generations": 1, "beta": None}),
        (DAPOConfig, "num_generations", {"num_generations": 1}),
        (ReMaxConfig, "num_generations", {"num_generations": 0}),
        # dual-clip: a bound > 1, on a token-level PPO-clip loss only
        (VariantConfig, "clip_ratio_c", {"clip_ratio_c": 1.0}),
        (RLOOConfig, "loss_type", {"clip_ratio_c": 3.0}),  # RLOO's default "luspo" is not a token-level clip loss
        (ReMaxConfig, "loss_type", {"clip_ratio_c": 3.0, "loss_type": "cispo"}),
        (ReMaxConfig, "loss_type", {"clip_ratio_c": 3.0, "loss_type": "sapo"}),
        (DAPOConfig, "loss_type", {"clip_ratio_c": 3.0, "loss_type": "vespo"}),
        (ReMaxConfig, "importance_sampling_level", {"clip_ratio_c": 3.0, "importance_sampling_level": "sequence"}),
        (ReMaxConfig, "off_policy_mask_threshold", {"clip_ratio_c": 3.0, "off_policy_mask_threshold": 0.5}),
        # GDPO's aggregation only where the advantage is GRPO's
        (ReMaxConfig, "multi_objective_aggregation", {"multi_objective_aggregation": "normalize_then_sum"}),
        (ReinforcePPConfig, "multi_objective_aggregation",
         {"multi_objective_aggregation": "normalize_then_sum", "beta": None}),
        (DAPOConfig, "multi_objective_aggregation", {"multi_objective_aggregation": "sum_then_sum"}),
        # the per-step token normaliser cannot see the micro-batches of a generation batch not generated yet
        (VariantConfig, "token_level_normalizer", {"token_level_normalizer": "batch"}),
        (ReMaxConfig, "steps_per_generation", {"gradient_accumulation_steps": 2, "steps_per_generation": 1}),
        (ReMaxConfig, "steps_per_generation", {"gradient_accumulation_steps": 2, "steps_per_generation": 3}),
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


def test_new_fields_are_accepted_where_they_have_a_meaning(tmp_path):
    """One sample per prompt (plain REINFORCE++, ReMax), dual-clip on every token-level PPO-clip loss, GDPO's
    aggregation for the GRPO-advantage configs, misaligned layouts with TRL's normaliser or a non-token loss."""
    assert toy_args(ReinforcePPConfig, tmp_path, num_generations=1, beta=None).num_generations == 1
    single = toy_args(ReMaxConfig, tmp_path, num_generations=1, per_device_train_batch_size=3)
    assert type(single.num_generations) is int and single.generation_batch_size == 3
    for cls in (ReMaxConfig, DAPOConfig, VariantConfig):
        assert toy_args(cls, tmp_path, clip_ratio_c=3.0).clip_ratio_c == 3.0
    assert toy_args(RLOOConfig, tmp_path, clip_ratio_c=3.0, loss_type="dapo",
                    importance_sampling_level="token").clip_ratio_c == 3.0
    assert toy_args(DAPOConfig, tmp_path, multi_objective_aggregation="normalize_then_sum")
    toy_args(ReMaxConfig, tmp_path, gradient_accumulation_steps=2, steps_per_generation=1,
             token_level_normalizer="generation_batch")
    toy_args(ReMaxConfig, tmp_path, gradient_accumulation_steps=2, steps_per_generation=1, loss_type="grpo")
    toy_args(ReMaxConfig, tmp_path, gradient_accumulation_steps=2, steps_per_generation=1, num_iterations=2)


# -------------------------------------------------------------------------------------------- dual-clip
@pytest.mark.timeout(120)
def test_dual_clip_for_a_trainer_without_critic(toy_model_dir, toy_dataset, tmp_path):
    """REINFORCE++ (token advantages, "dapo" loss) with `clip_ratio_c`: the loss of the tokens with A < 0 and a ratio
    above c goes from -A r to -A c, every other token is unchanged; logged as clip_ratio/dual_mean."""
    args = toy_args(ReinforcePPConfig, tmp_path, beta=None, kl_in_reward_coef=0.0, clip_ratio_c=3.0,
                    per_device_train_batch_size=16)
    trainer = ReinforcePPTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    model = trainer.model
    model.train()
    torch.manual_seed(0)
    batch = trainer._generate_and_score_completions([toy_dataset[i] for i in range(4) for _ in range(4)])
    trainer.current_gradient_accumulation_steps = 1
    mask = batch["completion_mask"].float()
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    att = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(model, ids, att, mask.shape[1])
    old = logps - 2.0  # ratio e^2 > c = 3 on every token

    def loss(c):
        trainer.args.clip_ratio_c = c
        with torch.no_grad():
            return trainer._compute_loss(model, {**batch, "old_per_token_logps": old}).item()

    adv = batch["advantages"]
    neg = (adv < 0).float() * mask
    assert neg.sum() > 0 and ((adv > 0).float() * mask).sum() > 0
    expected = (neg * adv * (torch.exp(torch.tensor(2.0)) - 3.0)).sum() / batch["num_items_in_batch"]
    assert loss(3.0) - loss(None) == pytest.approx(expected.item(), rel=1e-4)
    trainer.args.clip_ratio_c = 3.0
    loss(3.0)
    assert trainer._metrics["train"]["clip_ratio/dual_mean"][-1] == pytest.approx((neg.sum() / mask.sum()).item())


# -------------------------------------------------------------------------------------------- normalize_then_sum
def _three_rewards():
    """Three reward functions over a batch of 16 with None in places: row 5 unscorable (None everywhere), a
    function finite on one row only of a group (no std there), and one equal over a group."""
    def accuracy(completions, answer, **kwargs):
        out = addition_reward(completions, answer)
        return [None if i == 5 else v for i, v in enumerate(out)]

    def length(completions, **kwargs):
        return [None if i == 5 else float(len(c)) for i, c in enumerate(completions)]

    def sparse(completions, **kwargs):
        return [float(i % 3) if i < 4 or i == 8 else None for i in range(len(completions))]

    return [accuracy, length, sparse]


def _capture_rewards(trainer):
    captured = []
    calculate = trainer._calculate_rewards

    def keep(*args, **kwargs):
        out = calculate(*args, **kwargs)
        captured.append(out.clone())
        return out

    trainer._calculate_rewards = keep
    return captured


@pytest.mark.timeout(120)
def test_normalize_then_sum_equals_trl_bitwise(toy_model_dir, toy_dataset, tmp_path):
    """`advantages.normalize_then_sum_advantages` is TRL's GRPOTrainer with multi_objective_aggregation=
    "normalize_then_sum" (per-function group normalisation, weighted sum, batch normalisation), bit for bit."""
    from trl import GRPOConfig, GRPOTrainer

    from trl_ppo_variants.advantages import normalize_then_sum_advantages

    args = toy_args(GRPOConfig, tmp_path, per_device_train_batch_size=16, temperature=1.5,
                    multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.3, 2.0])
    trainer = GRPOTrainer(toy_model_dir, _three_rewards(), args=args, train_dataset=toy_dataset)
    captured = _capture_rewards(trainer)
    trainer.model.train()
    torch.manual_seed(0)
    out = trainer._generate_and_score_completions([toy_dataset[i] for i in range(4) for _ in range(4)])
    rewards = captured[0]
    spread = [rewards[:, k][~torch.isnan(rewards[:, k])].std() for k in range(2)]
    assert torch.isnan(rewards[5]).all() and min(spread) > 0
    ours = normalize_then_sum_advantages(rewards, trainer.reward_weights, 4)
    assert torch.equal(ours, out["advantages"])
    assert ours[5] == 0 and ours.abs().sum() > 1


# -------------------------------------------------------------------------------------------- token normaliser
def _token_trainer(toy_model_dir, toy_dataset, tmp_path, lengths, **overrides):
    """A REINFORCE++ trainer whose generation returns a fixed batch: one row per completion length in `lengths`
    (valid tokens then padding), advantage 1 everywhere, so that the on-policy loss of a micro-batch is
    -(its tokens) / (the normaliser)."""
    args = toy_args(ReinforcePPConfig, tmp_path, beta=None, kl_in_reward_coef=0.0, per_device_train_batch_size=1,
                    num_generations=2, max_completion_length=max(lengths), **overrides)
    trainer = ReinforcePPTrainer(toy_model_dir, addition_reward, args=args, train_dataset=toy_dataset)
    tok = trainer.processing_class
    n, width = len(lengths), max(lengths)
    prompt = torch.tensor(tok("3+4=")["input_ids"]).repeat(n, 1)
    completion_ids = torch.tensor(tok("0123456789" * 2)["input_ids"][:width]).repeat(n, 1)
    mask = (torch.arange(width).unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)).long()
    batch = {"prompt_ids": prompt, "prompt_mask": torch.ones_like(prompt), "completion_ids": completion_ids,
             "completion_mask": mask, "advantages": torch.ones(n), "num_items_in_batch": mask.sum()}
    trainer._generate_and_score_completions = lambda inputs: dict(batch)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return trainer


def _micro_batches(trainer, count):
    """(tokens, per-token weight of TRL's "dapo" normaliser, loss) of `count` consecutive micro-batches."""
    out = []
    torch.manual_seed(0)  # TRL shuffles the generation batch before splitting it
    for step in range(count):
        trainer._step = step
        inputs = trainer._prepare_inputs([{}])
        accum, spg = trainer.current_gradient_accumulation_steps, trainer.args.steps_per_generation
        normalizer = inputs["num_items_in_batch"].float() * accum / spg  # / processes (1)
        with torch.no_grad():
            loss = trainer._compute_loss(trainer.model, inputs).item()
        out.append((int(inputs["completion_mask"].sum()), 1.0 / normalizer.item(), loss))
    return out


@pytest.mark.timeout(120)
def test_each_optimizer_step_is_divided_by_its_own_tokens(toy_model_dir, toy_dataset, tmp_path):
    """The issue's example: one generation batch feeds two optimizer steps of 16 and 2 tokens. TRL divides both by
    the average 9; each step's tokens now weigh 1/16 and 1/2 (the step's loss is the token mean, -1 here)."""
    trainer = _token_trainer(toy_model_dir, toy_dataset, tmp_path, [16, 2], steps_per_generation=2)
    steps = sorted(_micro_batches(trainer, 2))
    assert [(tokens, weight) for tokens, weight, _ in steps] == [(2, pytest.approx(1 / 2)), (16, pytest.approx(1 / 16))]
    assert [loss for _, _, loss in steps] == [pytest.approx(-1.0), pytest.approx(-1.0)]

    trl_like = _token_trainer(toy_model_dir, toy_dataset, tmp_path / "trl", [16, 2], steps_per_generation=2,
                              token_level_normalizer="generation_batch")
    steps = sorted(_micro_batches(trl_like, 2))
    assert [weight for _, weight, _ in steps] == [pytest.approx(1 / 9)] * 2
    assert [loss for _, _, loss in steps] == [pytest.approx(-2 / 9), pytest.approx(-16 / 9)]


@pytest.mark.timeout(120)
def test_steps_of_several_micro_batches_sum_their_tokens(toy_model_dir, toy_dataset, tmp_path):
    """4 micro-batches per generation, 2 per optimizer step: each step is normalised by the tokens of its own two."""
    lengths = [16, 2, 5, 7]
    trainer = _token_trainer(toy_model_dir, toy_dataset, tmp_path, lengths, steps_per_generation=4,
                             gradient_accumulation_steps=2)
    micro = _micro_batches(trainer, 4)
    for first in (0, 2):
        (tokens_a, weight_a, loss_a), (tokens_b, weight_b, loss_b) = micro[first], micro[first + 1]
        assert weight_a == weight_b == pytest.approx(1 / (tokens_a + tokens_b))
        assert loss_a + loss_b == pytest.approx(-1.0)  # the step's token mean of -A, A = 1
    assert sorted(t for t, _, _ in micro) == sorted(lengths)


@pytest.mark.timeout(120)
def test_one_step_per_generation_batch_changes_nothing(toy_model_dir, toy_dataset, tmp_path):
    """steps_per_generation == gradient_accumulation_steps: the micro-batches are TRL's own objects, with TRL's count
    (the generation batch's tokens), so the per-token weights are bit-identical to GRPOTrainer's; eval untouched."""
    from trl import GRPOTrainer

    trainer = _token_trainer(toy_model_dir, toy_dataset, tmp_path, [16, 2], steps_per_generation=2,
                             gradient_accumulation_steps=2)
    micro = _micro_batches(trainer, 2)
    assert [w for _, w, _ in micro] == [1.0 / 18.0] * 2
    for step in range(2):
        trainer._step = step
        assert trainer._prepare_inputs([{}]) is trainer._buffered_inputs[step]
    torch.manual_seed(0)
    trainer._step, trainer._buffered_inputs = 0, None
    ours = trainer._prepare_inputs([{}])
    torch.manual_seed(0)
    trainer._step, trainer._buffered_inputs = 0, None
    trl = GRPOTrainer._prepare_inputs(trainer, [{}])
    assert all(torch.equal(ours[k], trl[k]) for k in trl)
    trainer.model.eval()
    assert trainer._prepare_inputs([{}])["num_items_in_batch"] == 18


# ------------------------------------------------------------------------------------------------ TRL's constructor
def _all_trainers():
    import importlib

    import trl_ppo_variants

    names = sorted(n[: -len("Trainer")] for n in trl_ppo_variants.__all__ if n.endswith("Trainer") and n != "VariantTrainer")
    return [(getattr(trl_ppo_variants, f"{n}Trainer"), getattr(trl_ppo_variants, f"{n}Config")) for n in names]


@pytest.mark.parametrize("trainer_cls, config_cls", _all_trainers(), ids=lambda c: c.__name__)
def test_constructor_takes_grpo_trainers_arguments(trainer_cls, config_cls, toy_model_dir, toy_dataset, tmp_path):
    """Issue 20: every trainer takes `GRPOTrainer.__init__`'s arguments as TRL does: by position too, and without
    `reward_funcs` (TRL's default None; its own "No reward source provided" when nothing else gives a reward)."""
    import inspect

    from trl import GRPOTrainer

    assert inspect.signature(trainer_cls.__init__).parameters["reward_funcs"].default is None
    extra = {"VAPOConfig": {"value_pretrain_steps": 0},
             "TTRLConfig": {"allow_labelled_rewards": True}}.get(config_cls.__name__, {})  # TTRL: a labelled reward
    args = toy_args(config_cls, tmp_path, **extra)
    trainer = trainer_cls(toy_model_dir, addition_reward, args, toy_dataset, toy_dataset.select(range(8)))
    assert trainer.train_dataset is toy_dataset and len(trainer.eval_dataset) == 8
    with pytest.raises(TypeError, match="multiple values for argument 'train_dataset'"):
        trainer_cls(toy_model_dir, addition_reward, args, toy_dataset, train_dataset=toy_dataset)
    if trainer_cls.__name__ == "TTRLTrainer":  # label-free: the majority vote is its reward
        assert trainer_cls(toy_model_dir, args=args, train_dataset=toy_dataset).reward_func_names[0] == "majority_vote"
        return
    with pytest.raises(ValueError, match="^No reward source provided|^reward_funcs|^step_reward_funcs"):
        trainer_cls(toy_model_dir, args=args, train_dataset=toy_dataset)
    from trl_ppo_variants.trainers.base import TRL_INIT_PARAMETERS  # what the positions are read against

    assert TRL_INIT_PARAMETERS == tuple(inspect.signature(GRPOTrainer.__init__).parameters)[1:]
