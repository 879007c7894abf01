"""ProcessGRPOTrainer (GRPO with process supervision, arXiv 2402.03300 Sec. 4.1.3): its advantages are the pure
functions' on the step rewards and step ends recomputed from the sampled completions; outcome only is GRPO; a process
reward model as the step source; the one-line errors; slow: the learning test on the digits task (per-digit step
reward against the exact-answer outcome reward, same trainer and budget) and a 2-process run with split groups."""

import math

import pytest
import torch
from conftest import toy_args
from launcher import accelerate_launch

from trl_ppo_variants.advantages import grpo_advantages, grpo_process_advantages, normalize_then_sum_advantages
from trl_ppo_variants.process import ProcessRewardModel, split_steps, step_end_tokens
from trl_ppo_variants.toy import addition_dataset, addition_reward, make_toy_prm
from trl_ppo_variants.trainers.process_grpo import ProcessGRPOConfig, ProcessGRPOTrainer

SEP = "1"  # a separator the toy model emits at temperature 2 (its tokenizer has no newline pairs)


def length_steps(completions, **kwargs):
    """A deterministic step reward that varies with the step and its position."""
    return [[len(step) - 0.5 * j for j, step in enumerate(split_steps(c, SEP))] for c in completions]


class Probe(ProcessGRPOTrainer):
    """Records the local completions TRL scored and what compute_advantages saw and returned."""

    def __init__(self, *args, **kwargs):
        self.records = []
        super().__init__(*args, **kwargs)

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        self._scored = (list(prompts), list(completions), [list(map(int, ids)) for ids in completion_ids_list])
        return super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)

    def compute_advantages(self, rewards, batch, group_size):
        self.captured_per_func = self.advantage_rewards_per_func
        advantages = super().compute_advantages(rewards, batch, group_size)
        steps = self.step_batch
        self.records.append({"scored": self._scored, "rewards": rewards.clone(), "group_size": group_size,
                             "mask": batch["completion_mask"].clone(), "advantages": advantages.clone(),
                             "steps": None if steps is None else (steps[0].clone(), steps[1].clone())})
        return advantages


def _train(tmp_path, toy_model_dir, reward_funcs, step_reward_funcs, **overrides):
    args = toy_args(ProcessGRPOConfig, tmp_path, step_separator=SEP, temperature=2.0, max_completion_length=8,
                    **overrides)
    trainer = Probe(toy_model_dir, reward_funcs, args=args, train_dataset=addition_dataset(64),
                    step_reward_funcs=step_reward_funcs)
    trainer.train()
    return trainer


def _expected_steps(trainer, record):
    """Step rewards and ends recomputed from the scored completions with the public helpers."""
    _, completions, ids = record["scored"]
    def decode(x):
        return trainer.processing_class.decode(x, skip_special_tokens=True)

    ends = [step_end_tokens(c, i, decode, SEP) for c, i in zip(completions, ids)]
    rewards = length_steps(completions)
    width = max(len(e) for e in ends)
    step_rewards = torch.full((len(ends), width), math.nan)
    step_ends = torch.zeros((len(ends), width), dtype=torch.long)
    for row, (e, r) in enumerate(zip(ends, rewards)):
        step_rewards[row, : len(e)] = torch.tensor(r)
        step_ends[row, : len(e)] = torch.tensor(e)
    return step_rewards, step_ends


def test_advantages_are_process_plus_outcome_on_the_mapped_steps(tmp_path, toy_model_dir):
    trainer = _train(tmp_path, toy_model_dir, addition_reward, [length_steps])
    assert len(trainer.records) == 2
    multi_step = False
    for rec in trainer.records:
        step_rewards, step_ends = _expected_steps(trainer, rec)
        torch.testing.assert_close(rec["steps"][0], step_rewards, equal_nan=True)
        assert torch.equal(rec["steps"][1], step_ends)
        multi_step |= bool(torch.isfinite(step_rewards).sum(1).max() > 1)
        mask = rec["mask"].float()
        expected = grpo_process_advantages(step_rewards, step_ends, mask, 4)
        expected = expected + grpo_advantages(rec["rewards"], 4).unsqueeze(1) * mask
        torch.testing.assert_close(rec["advantages"], expected, rtol=0, atol=1e-6)
        # the outcome passed to the estimator is the outcome function's, not the steps' sums TRL logged
        outcome = torch.tensor(addition_reward(rec["scored"][1], _answers(rec)))
        assert torch.equal(rec["rewards"], outcome)
    assert multi_step, "no completion had two steps: the test did not test anything"
    logged = [h for h in trainer.state.log_history if "process/steps" in h]
    assert len(logged) == 2 and all(h["process/steps"] >= 1 for h in logged)


def _answers(rec):
    from trl_ppo_variants.toy import addition_examples

    truth = {e["prompt"]: e["answer"] for e in addition_examples()}
    return [truth[p] for p in rec["scored"][0]]


def test_outcome_only_is_grpo_and_steps_only_is_the_paper(tmp_path, toy_model_dir):
    trainer = _train(tmp_path / "grpo", toy_model_dir, addition_reward, None)
    for rec in trainer.records:
        assert rec["steps"] is None
        expected = grpo_advantages(rec["rewards"], 4).unsqueeze(1) * rec["mask"].float()
        torch.testing.assert_close(rec["advantages"], expected, rtol=0, atol=0)
    trainer = _train(tmp_path / "process", toy_model_dir, None, [length_steps])
    assert not trainer.has_outcome_rewards
    for rec in trainer.records:
        assert torch.isnan(rec["rewards"]).all()
        step_rewards, step_ends = _expected_steps(trainer, rec)
        expected = grpo_process_advantages(step_rewards, step_ends, rec["mask"].float(), 4)
        torch.testing.assert_close(rec["advantages"], expected, rtol=0, atol=1e-6)


def _first_digit_reward(completions, **kwargs):
    return [float(any(ch.isdigit() for ch in c[:1])) for c in completions]


def test_normalize_then_sum_applies_to_the_outcome_rewards_only(tmp_path, toy_model_dir):
    """GDPO: each outcome function normalised within its group, summed, normalised over the batch (TRL's
    `normalize_then_sum`, `advantages.normalize_then_sum_advantages`); the step source's column takes no part."""
    trainer = _train(tmp_path, toy_model_dir, [addition_reward, _first_digit_reward], [length_steps],
                     multi_objective_aggregation="normalize_then_sum", max_steps=1)
    rec = trainer.records[0]
    per_func = trainer.captured_per_func.clone()
    per_func[:, 2] = float("nan")
    outcome = normalize_then_sum_advantages(per_func, trainer.reward_weights, 4)
    step_rewards, step_ends = _expected_steps(trainer, rec)
    expected = grpo_process_advantages(step_rewards, step_ends, rec["mask"].float(), 4)
    expected = expected + outcome.unsqueeze(1) * rec["mask"].float()
    torch.testing.assert_close(rec["advantages"], expected, rtol=0, atol=1e-6)
    assert outcome.abs().sum() > 0  # the outcome part is not trivially zero on this batch


def test_process_reward_model_as_the_step_source(tmp_path, toy_model_dir):
    prm_dir = make_toy_prm(str(tmp_path / "prm"), seed=1)
    trainer = _train(tmp_path, toy_model_dir, None, None, process_reward_model_path=prm_dir, max_steps=1)
    assert trainer.reward_func_names == ["process_reward_model"]
    rec = trainer.records[0]
    prm = ProcessRewardModel(prm_dir, separator=SEP)
    prompts, completions, _ = rec["scored"]
    scores = prm(prompts, completions)
    step_rewards = rec["steps"][0]
    for row, row_scores in enumerate(scores):
        assert step_rewards[row, : len(row_scores)].tolist() == pytest.approx(row_scores, abs=1e-6)
        assert torch.isnan(step_rewards[row, len(row_scores):]).all()
    assert rec["advantages"].abs().sum() > 0 and torch.isfinite(rec["advantages"]).all()


def test_a_step_function_with_the_wrong_count_stops_with_one_line(tmp_path, toy_model_dir):
    def bad_steps(completions, **kwargs):
        return [[1.0, 2.0] for _ in completions]  # most completions have one step

    with pytest.raises(RuntimeError) as info:
        _train(tmp_path, toy_model_dir, addition_reward, [bad_steps])
    message = str(info.value)
    assert "\n" not in message and "reward function 'bad_steps' raised ValueError: returned 2 step rewards for " \
        "completion 0, whose text has 1 steps (split on '1'" in message


@pytest.mark.parametrize("overrides,message", [
    ({"kl_in_reward_coef": 0.1}, "kl_in_reward_coef: expected 0.0 (GRPO with process supervision puts the KL"),
    ({"step_separator": ""}, "step_separator: expected a non-empty string"),
    ({"process_reward_model_style": "shepherd"}, "process_reward_model_style: expected one of ('auto', 'trl'"),
    ({"process_reward_model_step_tag": ""}, "process_reward_model_step_tag: expected None or a non-empty string"),
    ({"process_reward_model_path": "./no/such/prm"}, "process_reward_model_path: expected an existing local path"),
])
def test_config_errors(tmp_path, overrides, message):
    with pytest.raises(ValueError) as info:
        toy_args(ProcessGRPOConfig, tmp_path, **overrides)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_step_reward_funcs_must_be_plain_callables(tmp_path, toy_model_dir):
    async def async_steps(completions, **kwargs):
        return [[1.0] for _ in completions]

    args = toy_args(ProcessGRPOConfig, tmp_path)
    for bad, message in [(async_steps, "step_reward_funcs: expected synchronous functions"),
                         (toy_model_dir, "step_reward_funcs: expected callables returning, per completion, a list"),
                         (torch.nn.Linear(1, 1), "(reward models go in process_reward_model_path)")]:
        with pytest.raises(ValueError) as info:
            ProcessGRPOTrainer(toy_model_dir, addition_reward, args=args, step_reward_funcs=[bad],
                               train_dataset=addition_dataset(16))
        assert message in str(info.value)


# --------------------------------------------------------------------------------------------- learning (slow)
#: the measured setting (see the test's docstring): 4-digit digit-wise sums, 60 steps of 32 completions (G = 8)
LEARN_SEEDS = (0, 1, 2)
LEARN_STEPS = 60


@pytest.fixture(scope="module")
def digits_model_dir(tmp_path_factory):
    from trl_ppo_variants.toy import build_model, build_tokenizer, warm_start_digits

    path = str(tmp_path_factory.mktemp("digits_model"))
    tok = build_tokenizer()
    model = build_model(tok, seed=0)
    warm_start_digits(model, tok)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def _learn(model_dir, out_dir, seed, process: bool):
    from transformers import AutoTokenizer

    from trl_ppo_variants.toy import (
        DIGITS_SEPARATOR,
        digit_step_rewards,
        digits_accuracy,
        digits_dataset,
        digits_exact_reward,
    )

    args = ProcessGRPOConfig(
        output_dir=str(out_dir), per_device_train_batch_size=32, num_generations=8, max_completion_length=12,
        max_steps=LEARN_STEPS, learning_rate=5e-4, logging_steps=1, report_to=[], use_cpu=True, seed=seed,
        save_strategy="no", disable_tqdm=True, beta=0.0, temperature=1.0, step_separator=DIGITS_SEPARATOR,
        # both functions in both runs, so both are logged; the weight says which one trains
        reward_weights=[0.0, 1.0] if process else [1.0, 0.0],
    )
    tok = AutoTokenizer.from_pretrained(model_dir)
    trainer = ProcessGRPOTrainer(model_dir, digits_exact_reward, args=args, step_reward_funcs=[digit_step_rewards],
                                 train_dataset=digits_dataset(LEARN_STEPS * 4 + 64, seed=seed), processing_class=tok)
    trainer.train()
    history = [h["rewards/digit_step_rewards/mean"] / 4 for h in trainer.state.log_history
               if "rewards/digit_step_rewards/mean" in h]
    return digits_accuracy(trainer.model, tok)[0], history


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_process_supervision_beats_the_outcome_reward_on_the_same_budget(digits_model_dir, tmp_path):
    """The digits task (`toy.digits_examples`): "0123+3041=" -> "3, 1, 6, 4", one step per digit. The warm-started
    model is right on 45% of the digits and 4.5% of the answers. Same trainer, data, seed and budget (60 steps x 32
    completions, G = 8, lr 5e-4); only the reward differs: a per-digit step reward (process supervision) or 1 for an
    exact answer (outcome only, i.e. GRPO). Held-out per-digit accuracy after training (400 samples at temperature 1,
    0.458 before training), measured on CPU for seeds 0-4 (2026-12-04, after the generation and selection changes of
    issues 18/19 moved every trajectory): process 0.494 0.481 0.503 0.502 0.512, outcome 0.391 0.081 0.084 0.172 0.340,
    margins 0.103 0.401 0.419 0.329 0.172; the process run's gain over the untrained model +0.023 to +0.054. The
    outcome run degrades: its rare successful groups give large, sparse updates that Adam's moments keep applying.
    On 2026-12-05's CPU (AVX-512 with AMX: other rounding, a warm start of 0.402) the same seeds gave process 0.451
    0.451 0.459 0.471 0.452, outcome 0.326 0.418 0.272 0.364 0.406: margins 0.124 0.033 0.188 0.107 0.046, gains +0.049
    to +0.069. Asserted: process beats outcome on every seed, by more than 0.06 on average, and gains on every seed.
    (The process run's logged training reward is too noisy a learning signal to assert on: its last quarter minus
    its first was -0.008 to +0.126 over the same seeds.)
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trl_ppo_variants.toy import digits_accuracy

    before = digits_accuracy(AutoModelForCausalLM.from_pretrained(digits_model_dir),
                             AutoTokenizer.from_pretrained(digits_model_dir))[0]
    margins = []
    for seed in LEARN_SEEDS:
        process, _ = _learn(digits_model_dir, tmp_path / f"process{seed}", seed, process=True)
        outcome, _ = _learn(digits_model_dir, tmp_path / f"outcome{seed}", seed, process=False)
        margins.append(process - outcome)
        assert process - outcome > 0, (seed, process, outcome)  # smallest measured margin 0.033 (seed 1, 12-05)
        assert process - before > 0.01, (seed, before, process)  # smallest measured gain +0.023 (seed 1, 12-04)
    assert sum(margins) / len(margins) > 0.06, margins  # measured means 0.308 (12-04) and 0.115 (12-05)


# --------------------------------------------------------------------------------------------- 2 processes (slow)
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_processes_split_groups(toy_model_dir, tmp_path, machines):
    """Per-device batch 6, G = 4: the middle group straddles the ranks. Both ranks compute the same advantages, equal
    to the pure function on step rewards and ends recomputed in one process from every completion; the ranks pad
    their step lists to the same width; the weights end identical. Script: tests/scripts/process_grpo_2proc.py.
    """
    accelerate_launch("process_grpo_2proc.py", toy_model_dir, tmp_path, machines=machines)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    assert [r["global_step"] for r in ranks] == [3, 3]
    torch.testing.assert_close(ranks[0]["weights"], ranks[1]["weights"], rtol=0, atol=0)
    saw_uneven = False
    for step, (rec0, rec1) in enumerate(zip(ranks[0]["records"], ranks[1]["records"])):
        for key in ("step_rewards", "step_ends", "advantages", "expected_step_rewards", "expected_step_ends"):
            assert torch.equal(rec0[key].nan_to_num(-7.0), rec1[key].nan_to_num(-7.0)), (step, key)
        assert rec0["step_rewards"].shape[0] == 12 and rec0["group_size"] == 4
        torch.testing.assert_close(rec0["step_rewards"], rec0["expected_step_rewards"], equal_nan=True)
        assert torch.equal(rec0["step_ends"], rec0["expected_step_ends"])
        expected = grpo_process_advantages(rec0["expected_step_rewards"], rec0["expected_step_ends"],
                                           rec0["mask"].float(), 4)
        expected = expected + grpo_advantages(rec0["rewards"], 4).unsqueeze(1) * rec0["mask"].float()
        torch.testing.assert_close(rec0["advantages"], expected, rtol=0, atol=1e-6)
        saw_uneven |= rec0["local_steps"] != rec1["local_steps"]
        for rank, rec in enumerate((rec0, rec1)):  # each rank trains on its own contiguous slice
            width = rec["local_advantages"].shape[1]
            assert torch.equal(rec["local_advantages"], rec0["advantages"][rank * 6 : (rank + 1) * 6, :width])
    assert saw_uneven, "the ranks never had different step counts: the padding to a common width was not tested"
