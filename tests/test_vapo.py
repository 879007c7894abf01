"""VAPOTrainer: value pre-training (policy frozen, critic learning, resumable), decoupled and length-adaptive GAE,
the positive-example LM loss, PEFT/LoRA, learning, and 2-process runs under DDP, DeepSpeed ZeRO-2 and ZeRO-3."""

import json

import pytest
import torch
from conftest import logged_rewards, quarter_means, toy_args
from launcher import ROOT, accelerate_launch
from safetensors import safe_open
from transformers import TrainerCallback

from trl_ppo_variants.advantages import gae, masked_whiten
from trl_ppo_variants.critic import critic_values, is_critic_key
from trl_ppo_variants.toy import addition_reward
from trl_ppo_variants.trainers.vapo import VAPOConfig, VAPOTrainer

G = 4


def _args(tmp_path, **overrides):
    return toy_args(VAPOConfig, tmp_path, **{"critic_learning_rate": 1e-3, "value_pretrain_steps": 1, **overrides})


def _trainer(model_dir, dataset, tmp_path, reward=addition_reward, callbacks=None, **overrides):
    return VAPOTrainer(model_dir, reward, args=_args(tmp_path, **overrides), train_dataset=dataset,
                       callbacks=callbacks)


class Snapshots(TrainerCallback):
    """Policy and critic parameters (cloned) at the start and after every optimizer step."""

    def __init__(self):
        self.trainer, self.steps = None, {}

    def _take(self, step):
        model = self.trainer.model
        self.steps[step] = {n: p.detach().clone() for n, p in model.named_parameters()}

    def on_train_begin(self, args, state, control, **kwargs):
        self._take(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self._take(state.global_step)


def _moved(a, b, critic):
    return any(not torch.equal(a[n], b[n]) for n in a if n.startswith("critic.") == critic)


def assert_frozen_for_two_steps(s):
    """Snapshots `s` of 4 steps with a critic warm-up of 2: during it the policy is bit-identical (weight decay 0.1
    would shrink it otherwise) and the critic learns; after it both learn."""
    assert not _moved(s[0], s[1], critic=False) and not _moved(s[0], s[2], critic=False)
    assert _moved(s[0], s[1], critic=True) and _moved(s[1], s[2], critic=True)
    assert _moved(s[2], s[3], critic=False) and _moved(s[3], s[4], critic=False)
    assert _moved(s[2], s[3], critic=True)


# ------------------------------------------------------------------------------------------------ config
def test_defaults_follow_the_paper(tmp_path):
    args = VAPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    assert (args.epsilon, args.epsilon_high, args.loss_type) == (0.2, 0.28, "dapo")
    assert (args.value_pretrain_steps, args.lam_critic, args.lam_policy) == (50, 1.0, 0.95)
    assert (args.length_adaptive_alpha, args.positive_lm_coef) == (0.05, 0.1)
    assert (args.learning_rate, args.critic_learning_rate, args.effective_critic_learning_rate) == (1e-6, None, 2e-6)
    # the paper's full value model, not PPO's LoRA default (issue 28: VAPO's LoRA critic learned 23% of the full
    # critic's gain on SmolLM2)
    assert args.critic_backbone == "full"
    # the paper's ratio follows the policy's rate; a set critic rate is kept
    scaled = VAPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=2e-5)
    assert scaled.effective_critic_learning_rate == 4e-5
    fixed = VAPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], critic_learning_rate=3e-6)
    assert fixed.effective_critic_learning_rate == 3e-6
    # a LoRA critic (not in the paper): ten times the full critic's rate; a set rate is kept as it is
    lora = VAPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], critic_backbone="lora")
    assert lora.effective_critic_learning_rate == pytest.approx(2e-5)
    lora_fixed = VAPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], critic_backbone="lora",
                            critic_learning_rate=3e-6)
    assert lora_fixed.effective_critic_learning_rate == 3e-6
    assert (args.kl_in_reward_coef, args.beta) == (0.0, 0.0)


@pytest.mark.parametrize("field, value, extra", [
    ("value_pretrain_steps", -1, {}),
    ("critic_warmup_steps", 3, {"value_pretrain_steps": 1}),  # PPO's name for the same setting: unset or equal
    ("lr_scheduler_type", "reduce_lr_on_plateau", {"eval_strategy": "steps", "eval_steps": 1}),
    ("value_pretrain_steps", 2, {"max_steps": 2}),
    ("lam_critic", 1.5, {}),
    ("lam_policy", -0.5, {}),
    ("length_adaptive_alpha", 0.0, {}),
    ("positive_lm_coef", -0.1, {}),
])
def test_bad_config_is_one_line_error_naming_the_field(tmp_path, field, value, extra):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        _args(tmp_path, **{field: value, **extra})


def test_unknown_positive_reward_func(toy_model_dir, toy_dataset, tmp_path):
    with pytest.raises(ValueError, match="^positive_reward_func: expected one of the reward function names"):
        _trainer(toy_model_dir, toy_dataset, tmp_path, positive_reward_func="accuracy")


# ------------------------------------------------------------------------------------------------ advantages
def _synthetic_batch():
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.float32)
    values = torch.tensor([[0.1, 9, 9, 9], [0.2, 0.3, 9, 9], [0.5, -0.2, 0.4, 0.1], [0.0, 0.6, -0.3, 9]])
    return {"completion_mask": mask, "old_values": values * mask}, torch.tensor([1.0, 0.0, 1.0, float("nan")])


def test_decoupled_length_adaptive_gae(toy_model_dir, toy_dataset, tmp_path):
    trainer = _trainer(toy_model_dir, toy_dataset, tmp_path, length_adaptive_alpha=0.5)
    batch, rewards = _synthetic_batch()
    advantages = trainer.compute_advantages(rewards, batch, G)
    targets = trainer._targets
    valid = batch["completion_mask"].clone()
    valid[3] = 0.0  # the unscorable row has no target and no advantage
    token_rewards = torch.zeros(4, 4)
    token_rewards[0, 0], token_rewards[2, 3] = 1.0, 1.0
    # lam_critic = 1: the critic's targets are the Monte-Carlo returns, i.e. the outcome at every valid token
    assert torch.equal(targets["returns"], torch.tensor([1.0, 0.0, 1.0, 0.0]).unsqueeze(1) * valid)
    # policy: lam = 1 - 1 / (0.5 l) for l = 1, 2, 4, 3 -> 0 (clamped), 0, 0.5, 1/3
    lam = torch.tensor([0.0, 0.0, 0.5, 1.0 / 3.0])
    expected, _ = gae(token_rewards, batch["old_values"] * valid, valid, gamma=1.0, lam=lam)
    assert torch.allclose(advantages, masked_whiten(expected, valid), atol=1e-6)
    # row 1 (lam = 0, reward 0): one-step TD, A_0 = V_1 - V_0 = 0.1, A_1 = 0 - V_1 = -0.3 (before whitening)
    assert expected[1, :2].tolist() == pytest.approx([0.1, -0.3])
    # the positive-example targets: reward >= 1 (NaN never), and their token count
    assert targets["positive"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert targets["num_positive_tokens"].item() == 5.0

    trainer.args.length_adaptive_alpha = None  # decoupled GAE alone: the fixed lam_policy
    advantages = trainer.compute_advantages(rewards, batch, G)
    expected, _ = gae(token_rewards, batch["old_values"] * valid, valid, gamma=1.0, lam=0.95)
    assert torch.allclose(advantages, masked_whiten(expected, valid), atol=1e-6)
    assert torch.equal(trainer._targets["returns"], torch.tensor([1.0, 0.0, 1.0, 0.0]).unsqueeze(1) * valid)


def test_positive_rows_from_total_or_named_reward(toy_model_dir, toy_dataset, tmp_path):
    def accuracy(completions, **kwargs):
        return [0.0] * len(completions)

    def style(completions, **kwargs):
        return [0.0] * len(completions)

    trainer = VAPOTrainer(toy_model_dir, [accuracy, style], args=_args(tmp_path, reward_weights=[1.0, 0.5]),
                          train_dataset=toy_dataset)
    per_func = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [float("nan"), float("nan")]])
    trainer._captured_rewards_per_func = per_func
    total = trainer.total_rewards(per_func)  # 1.0, 0.5, 1.5, NaN
    assert trainer.positive_rows(total).tolist() == [True, False, True, False]
    trainer.args.positive_reward_func = "style"
    assert trainer.positive_rows(total).tolist() == [False, True, True, False]


# ------------------------------------------------------------------------------------------------ loss
def test_loss_during_and_after_value_pretraining(toy_model_dir, toy_dataset, tmp_path):
    def half_correct(completions, **kwargs):
        return [float(i % 2 == 0) for i in range(len(completions))]

    trainer = _trainer(toy_model_dir, toy_dataset, tmp_path, reward=half_correct, value_pretrain_steps=1,
                       max_steps=2, vf_coef=0.5)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    batch = trainer._generate_and_score_completions([dict(toy_dataset[i]) for i in range(2) for _ in range(G)])
    mask = batch["completion_mask"].float()
    assert batch["positive"].tolist() == [1.0, 0.0] * 4
    input_ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    attention_mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)
    with torch.no_grad():
        logps, _, _ = trainer._get_per_token_logps_and_entropies(trainer.model, input_ids, attention_mask,
                                                                 mask.shape[1])
    value_loss = (0.5 * (batch["old_values"] - batch["returns"]) ** 2 * batch["value_mask"]).sum()
    value_loss = value_loss / batch["num_items_in_batch"]

    def loss(coef):
        trainer.args.positive_lm_coef = coef
        with torch.no_grad():
            return trainer._compute_loss(trainer.model, batch).item()

    # pre-training: the policy part (PPO loss and NLL) is multiplied by 0
    assert loss(0.1) == pytest.approx(0.5 * value_loss.item(), abs=1e-6)
    assert trainer._metrics["train"]["value_pretraining"][-1] == 1.0
    trainer.state.global_step = 1
    pos = mask * batch["positive"].unsqueeze(1)
    nll = (-logps * pos).sum() / pos.sum()  # the paper's token mean over the correct completions
    assert loss(0.1) - loss(0.0) == pytest.approx(0.1 * nll.item(), rel=1e-4)
    assert trainer._metrics["train"]["positive/nll"][-1] == pytest.approx(nll.item(), rel=1e-4)


# ------------------------------------------------------------------------------------------------ value pre-training
def test_value_pretraining_freezes_the_policy_only(toy_model_dir, toy_dataset, tmp_path):
    snaps = Snapshots()
    trainer = _trainer(toy_model_dir, toy_dataset, tmp_path, callbacks=[snaps], max_steps=4, value_pretrain_steps=2,
                       weight_decay=0.1)
    snaps.trainer = trainer
    trainer.train()
    assert_frozen_for_two_steps(snaps.steps)
    logged = [h["value_pretraining"] for h in trainer.state.log_history if "value_pretraining" in h]
    assert logged == [1.0, 1.0, 0.0, 0.0]
    # the policy's Adam state restarted when pre-training ended: 2 steps counted, the critic's 4
    state = trainer.optimizer.state
    assert state[trainer.model.model.embed_tokens.weight]["step"].item() == 2
    assert state[trainer.critic.model.embed_tokens.weight]["step"].item() == 4


def test_value_pretraining_counter_survives_resume(toy_model_dir, toy_dataset, tmp_path):
    class StopAfterOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = True

    run = dict(max_steps=4, value_pretrain_steps=2, save_strategy="steps", save_steps=1)
    first = _trainer(toy_model_dir, toy_dataset, tmp_path / "a", callbacks=[StopAfterOne()], **run)
    first.train()
    assert first.state.global_step == 1
    snaps = Snapshots()
    second = _trainer(toy_model_dir, toy_dataset, tmp_path / "b", callbacks=[snaps], **run)
    snaps.trainer = second
    second.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-1"))
    s = snaps.steps
    assert sorted(s) == [1, 2, 3, 4]
    assert not _moved(s[1], s[2], critic=False) and _moved(s[1], s[2], critic=True)  # step 2 still pre-trains
    assert _moved(s[2], s[3], critic=False)
    assert second.optimizer.state[second.model.model.embed_tokens.weight]["step"].item() == 2


class LearningRates(TrainerCallback):
    """The learning rate each optimizer step ran with, of the policy's and the critic's param groups."""

    def __init__(self):
        self.trainer, self.policy, self.critic = None, [], []

    def on_optimizer_step(self, args, state, control, **kwargs):  # after optimizer.step(), before scheduler.step()
        from trl_ppo_variants.trainers.ppo import GROUP_ROLE

        groups = self.trainer.optimizer.param_groups
        self.policy.append(next(g["lr"] for g in groups if g[GROUP_ROLE] == "policy"))
        self.critic.append(next(g["lr"] for g in groups if g[GROUP_ROLE] == "critic"))


def _rates(toy_model_dir, toy_dataset, tmp_path, **overrides):
    rates = LearningRates()
    trainer = _trainer(toy_model_dir, toy_dataset, tmp_path, callbacks=[rates], **overrides)
    rates.trainer = trainer
    trainer.train()
    return trainer, rates


def test_policy_schedule_starts_when_value_pretraining_ends(toy_model_dir, toy_dataset, tmp_path):
    """Linear decay over 5 steps, 2 of value pre-training: the policy's first step runs at the full learning rate and
    its schedule decays over its own 3 steps; the critic decays over all 5 from step 0 (its own rate, 2e-3)."""
    trainer, rates = _rates(toy_model_dir, toy_dataset, tmp_path, max_steps=5, value_pretrain_steps=2,
                            lr_scheduler_type="linear", learning_rate=1e-3, critic_learning_rate=2e-3)
    assert rates.policy == pytest.approx([0.0, 0.0, 1e-3, 1e-3 * 2 / 3, 1e-3 / 3])
    assert rates.critic == pytest.approx([2e-3 * (5 - s) / 5 for s in range(5)])
    logged = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert logged == pytest.approx(rates.policy)  # transformers logs the policy's rate (the first param group)
    critic_logged = [h["value/learning_rate"] for h in trainer.state.log_history if "value/learning_rate" in h]
    assert critic_logged == pytest.approx(rates.critic)


def test_policy_warmup_completes_after_value_pretraining(toy_model_dir, toy_dataset, tmp_path):
    """warmup_steps = 2 = value_pretrain_steps: the policy still warms up (0, 1/2, then the full rate); the critic
    warms up from step 0."""
    _, rates = _rates(toy_model_dir, toy_dataset, tmp_path, max_steps=5, value_pretrain_steps=2, warmup_steps=2,
                      lr_scheduler_type="constant_with_warmup", learning_rate=1e-3, critic_learning_rate=1e-3)
    assert rates.policy == pytest.approx([0.0, 0.0, 0.0, 0.5e-3, 1e-3])
    assert rates.critic == pytest.approx([0.0, 0.5e-3, 1e-3, 1e-3, 1e-3])


def test_positive_tokens_are_counted_per_optimizer_step(toy_model_dir, toy_dataset, tmp_path):
    """With two optimizer steps per generation batch, the positive-example NLL is a token mean over the correct
    completions of its own step: `num_positive_tokens` is set per step like `num_items_in_batch`."""
    trainer = _trainer(toy_model_dir, toy_dataset, tmp_path, per_device_train_batch_size=2, num_generations=2,
                       steps_per_generation=2)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    batch = {"prompt_ids": torch.ones(4, 2, dtype=torch.long), "prompt_mask": torch.ones(4, 2, dtype=torch.long),
             "completion_ids": torch.ones(4, 4, dtype=torch.long), "completion_mask": mask,
             "advantages": torch.zeros(4, 4), "positive": torch.tensor([1.0, 0.0, 1.0, 1.0]),
             "num_items_in_batch": mask.sum(), "num_positive_tokens": torch.tensor(8.0)}
    trainer._generate_and_score_completions = lambda inputs: dict(batch)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = 1
    torch.manual_seed(0)
    for step in range(2):
        trainer._step = step
        inputs = trainer._prepare_inputs([{}])
        local = inputs["completion_mask"].float()
        # TRL's "dapo" normaliser of a step: count / processes * accumulation / steps_per_generation
        assert inputs["num_items_in_batch"] / 2 == local.sum()
        assert inputs["num_positive_tokens"] / 2 == (local * inputs["positive"].unsqueeze(1)).sum()


# ------------------------------------------------------------------------------------------------ PEFT
def test_lora_policy_with_full_critic(toy_model_dir, toy_dataset, tmp_path):
    from peft import LoraConfig

    snaps = Snapshots()
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    run = dict(max_steps=3, value_pretrain_steps=1, save_strategy="steps", save_steps=3)
    trainer = VAPOTrainer(toy_model_dir, addition_reward, args=_args(tmp_path / "a", **run),
                          train_dataset=toy_dataset, peft_config=lora, callbacks=[snaps])
    snaps.trainer = trainer
    names = [n for n, _ in trainer.model.named_parameters()]
    assert not any("critic" in n and "lora" in n for n in names)  # the LoRA patterns did not catch the critic
    assert all(p.requires_grad for n, p in trainer.model.named_parameters() if ".critic." in n)
    trainer.train()
    s = snaps.steps
    lora_moved = any(not torch.equal(s[1][n], s[3][n]) for n in names if "lora_" in n)
    base_moved = any(not torch.equal(s[0][n], s[3][n]) for n in names if "lora_" not in n and ".critic." not in n)
    assert lora_moved and not base_moved
    assert all(not torch.equal(s[0][n], s[3][n]) for n in names if ".critic." in n and "norm" not in n)

    checkpoint = tmp_path / "a" / "out" / "checkpoint-3"
    with safe_open(str(checkpoint / "adapter_model.safetensors"), "pt") as f:
        assert not any("critic" in k for k in f.keys())
    assert (checkpoint / "value_model" / "model.safetensors").exists()  # PEFT saves only the adapter

    resumed = VAPOTrainer(toy_model_dir, addition_reward, args=_args(tmp_path / "b", **run),
                          train_dataset=toy_dataset, peft_config=lora)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    for (name, p), q in zip(trainer.critic.named_parameters(), resumed.critic.parameters()):
        assert torch.equal(p, q), name
    trainer.save_model(str(tmp_path / "export"))
    assert (tmp_path / "export" / "value_model" / "config.json").exists()
    assert (tmp_path / "export" / "adapter_config.json").exists()


# ------------------------------------------------------------------------------------------------ learning
LEARN_STEPS, LEARN_LR, LEARN_SEED, LEARN_MARGIN = 120, 1e-3, 0, 0.1


@pytest.mark.timeout(240)
@pytest.mark.parametrize("critic_backbone", ["full", "lora"])
def test_vapo_learns(tmp_path, toy_model_dir, critic_backbone):
    """Seeded: mean sampled reward, last quarter vs first quarter. Measured over seeds 0-7 (gain: mean [min, max]):
    full critic +0.15 [0.01, 0.24], seed 0 +0.22; LoRA critic (a frozen copy: VAPO has no KL, so no reference model)
    +0.18 [0.06, 0.26], seed 0 +0.20. (120 steps: see test_ppo_learns for why 60 were too few.) The toy's completions
    have at most 4 tokens, so alpha = 1 stands in for the paper's 0.05 (which would give lam_policy = 0, one-step TD
    from a barely trained critic, for every completion shorter than 20 tokens)."""
    from trl_ppo_variants.toy import addition_dataset

    args = _args(tmp_path, max_steps=LEARN_STEPS, per_device_train_batch_size=16, learning_rate=LEARN_LR,
                 temperature=1.0, seed=LEARN_SEED, value_pretrain_steps=5, length_adaptive_alpha=1.0,
                 critic_backbone=critic_backbone)
    trainer = VAPOTrainer(toy_model_dir, addition_reward, args=args,
                          train_dataset=addition_dataset(16 * LEARN_STEPS, seed=LEARN_SEED))
    trainer.train()
    first, last = quarter_means(logged_rewards(trainer))
    assert last > first + LEARN_MARGIN, (first, last)


# ------------------------------------------------------------------------------------------------ 2 processes
DDP = None  # accelerate launch --multi_gpu
ZERO2 = ROOT / "tests" / "configs" / "critic_zero2.yaml"
ZERO3 = ROOT / "tests" / "configs" / "critic_zero3.yaml"


@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("backend, config_file, critic", [
    ("ddp", DDP, "full"),
    ("zero2", ZERO2, "full"),
    pytest.param("zero3", ZERO3, "full", marks=pytest.mark.multinode),  # also as two machines in `make test`
    ("ddp", DDP, "lora"),
    ("zero2", ZERO2, "lora"),
    ("zero3", ZERO3, "lora"),
    ("ddp", DDP, "lora-reference"),
    ("zero2", ZERO2, "lora-reference"),
    ("ddp", DDP, "lora-peft"),
    ("zero2", ZERO2, "lora-peft"),
])
def test_two_processes(tmp_path, toy_model_dir, backend, config_file, critic, machines):
    """3 steps (1 of value pre-training) on 2 CPU processes: finite losses, identical weights on both ranks at every
    step, the policy untouched by pre-training, a checkpoint holding the critic, an export without it. LoRA critics:
    over a frozen copy, the reference model's weights (which never move) or the LoRA policy's base (a second adapter)."""
    accelerate_launch("critic_2proc.py", toy_model_dir, tmp_path, critic, config_file=config_file, timeout=230,
                      machines=machines)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["world"] for r in ranks] == [2, 2]
    assert ranks[0]["deepspeed_stage"] == {"ddp": None, "zero2": 2, "zero3": 3}[backend]
    expected_base = {"full": "own", "lora": "copy", "lora-reference": "reference", "lora-peft": "policy_adapter"}
    assert ranks[0]["critic_base"] == expected_base[critic]
    assert ranks[0]["steps"] == ranks[1]["steps"]  # the same weights on both ranks, at every step
    steps = ranks[0]["steps"]
    assert [s["step"] for s in steps] == [0, 1, 2, 3]
    assert steps[0]["policy"] == steps[1]["policy"] != steps[2]["policy"] != steps[3]["policy"]
    assert steps[0]["critic"] != steps[1]["critic"] != steps[2]["critic"]
    if critic == "lora-reference":
        assert len({s["reference"] for s in steps}) == 1  # the shared weights never move
    logs = ranks[0]["logs"]
    assert len(logs) == 3 and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert [h["value_pretraining"] for h in logs] == [1.0, 0.0, 0.0]
    # the policy's schedule starts after pre-training (rate 0 before, the full rate then: linear decay over its own 2
    # steps), the critic's from step 0: also with DeepSpeed's optimizer wrapper
    assert [h["learning_rate"] for h in logs] == pytest.approx([0.0, 1e-3, 0.5e-3])
    assert [h["value/learning_rate"] for h in logs] == pytest.approx([1e-3, 1e-3 * 2 / 3, 1e-3 / 3])
    # the policy's optimizer state was found and dropped once, when pre-training ended (at step 2)
    assert len(ranks[0]["policy_state_entries_reset"]) == 1 and ranks[0]["policy_state_entries_reset"][0] > 0
    main = ranks[0]
    assert main["export_keys"] and not any("critic" in k for k in main["export_keys"])
    # the critic next to the exported policy: the backbone and head (26 tensors), or the adapter (A and B on the 7
    # projections of 2 layers) and the head
    assert len(main["value_model_keys"]) == (26 if critic == "full" else 2 * 7 * 2 + 2)
    # the checkpoint: the policy's weights alone (transformers pushes them as they are), the critic in value_model/
    assert main["checkpoint_keys"] and not any(is_critic_key(k) for k in main["checkpoint_keys"])
    assert "value_model" in main["checkpoint_files"]
