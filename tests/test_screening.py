"""Pre-generation prompt selection (`trl_ppo_variants/screening.py`): SPEED's screening, GRESO's skipping and DAPO's
dynamic sampling as one loop, for every group estimator; `trl_ppo_variants.GRPOTrainer`. The 2-process runs are in
tests/test_dapo.py (tests/scripts/dapo_2proc.py --mode speed); the accumulator's segments in tests/test_selection.py."""

import math
import re

import pytest
import torch
from conftest import addition_answer, toy_args
from reliability_helpers import StopAt, modules_state, step_logs

import trl_ppo_variants as tpv
from trl_ppo_variants import screening
from trl_ppo_variants.advantages import (
    grpo_advantages,
    grpo_process_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from trl_ppo_variants.process import outcome_as_one_step
from trl_ppo_variants.toy import addition_dataset, addition_reward


# ------------------------------------------------------------------------------------------------ pure rules
@pytest.mark.parametrize("streak, p_easy, p_hard, expected", [
    (0, 0.5, 0.5, 0.0),  # never generated, or its last group had a spread: always kept
    (1, 0.5, 0.9, 0.5),  # one all-correct group: kept with p_easy
    (2, 0.5, 0.9, 0.75),  # 1 - 0.5^2
    (-2, 0.5, 0.9, 1 - 0.81),  # two all-wrong groups: p_hard^2
    (10, 0.5, 0.9, 0.99),  # 0.5^10 < 0.01: the floor keeps 1% exploration
])
def test_greso_skip_probability(streak, p_easy, p_hard, expected):
    assert screening.greso_skip_probability(streak, p_easy, p_hard) == pytest.approx(expected)


def test_greso_streaks_and_exploration_updates():
    assert [screening.next_streak(s, o) for s, o in [(0, "easy"), (2, "easy"), (-3, "easy"), (2, "hard"),
                                                      (-1, "hard"), (5, "spread"), (-5, "spread")]] == \
        [1, 3, 1, -1, -2, 0, 0]
    # above the target: skip more (p down), below: skip less (p up), clamped to the bounds
    assert screening.update_exploration(0.5, 0.2, 0.1, 0.01, 0.05, 0.95) == pytest.approx(0.49)
    assert screening.update_exploration(0.5, 0.05, 0.1, 0.01, 0.05, 0.95) == pytest.approx(0.51)
    assert screening.update_exploration(0.05, 0.9, 0.1, 0.01, 0.05, 0.95) == 0.05
    assert screening.update_exploration(0.95, 0.0, 0.1, 0.01, 0.05, 0.95) == 0.95


def test_default_screening_size_is_speeds_four_for_large_groups():
    assert [screening.default_screening_size(g) for g in (3, 4, 6, 8, 16, 24)] == [2, 2, 3, 4, 4, 4]


@pytest.mark.parametrize("screen, complete, n, G, world, expected", [
    (3, 2, 2, 4, 1, (3, 2)),  # one process: as asked
    (3, 2, 2, 4, 2, (3, 2)),  # 6 + 4 rows split over 2
    (3, 1, 2, 3, 2, (3, 0)),  # 6 + 1 rows do not split: the completion waits, the screening goes
    (1, 1, 2, 3, 4, (2, 0)),  # 2s + 1 rows never split over 4: the completion waits, 2 screenings (4 rows) go
    (0, 2, 3, 4, 2, (0, 2)),  # completion only: 2 rows
    (0, 1, 3, 4, 2, (1, 1)),  # 1 completion row: one extra screening (3 rows) makes 4
    (0, 0, 2, 4, 2, (0, 0)),  # nothing to do
])
def test_plan_round(screen, complete, n, G, world, expected):
    s, c = screening.plan_round(screen, complete, n, G, world)
    assert (s, c) == expected
    if s or c:
        assert (s * n + c * (G - n)) % world == 0 and s >= screen and c <= complete


def test_row_key_groups_duplicates_and_separates_answers():
    a = {"prompt": "1+2=", "answer": "3"}
    assert screening.row_key(dict(a)) == screening.row_key({"answer": "3", "prompt": "1+2="})  # column order
    assert screening.row_key(a) != screening.row_key({"prompt": "1+2=", "answer": "4"})
    assert len(screening.row_key(a)) == 16


def _no_records():
    yield from ()


def test_stream_prompts_resume_where_they_stopped():
    from datasets import Dataset

    stream = Dataset.from_dict({"prompt": [f"q{i}" for i in range(10)]}).to_iterable_dataset()
    a = screening.StreamPrompts(stream, seed=0, shuffle=True)
    first = a.draw(3, set())
    state = a.state_dict()
    rest = a.draw(7, set()) + a.draw(5, set())  # the second draw crosses into a second pass (reshuffled)
    assert sorted(r["prompt"] for r in first + rest[:7]) == [f"q{i}" for i in range(10)]  # a pass is a permutation
    b = screening.StreamPrompts(stream, seed=0, shuffle=True)
    b.load_state_dict(state)
    assert b.draw(7, set()) + b.draw(5, set()) == rest
    assert a.epoch == 1 and a.pass_length == 10
    seen = {r["prompt"] for r in rest[7:]}  # skips seen prompts, then gives up after a pass's worth of skips
    assert not {r["prompt"] for r in a.draw(5, seen)} & {r["prompt"] for r in rest[7:]}
    assert len(a.draw(20, {f"'q{i}'" for i in range(10)})) == 20
    from datasets import IterableDataset

    empty = IterableDataset.from_generator(_no_records)
    with pytest.raises(ValueError, match="^train_dataset: expected a stream with at least one record"):
        screening.StreamPrompts(empty, seed=0, shuffle=False).draw(1, set())


# ------------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("config, overrides, reason", [
    (tpv.PPOConfig, {}, "learned critic"),
    (tpv.VAPOConfig, {}, "learned critic"),
    (tpv.ReMaxConfig, {}, "greedy completion"),
    (tpv.TTRLConfig, {}, "majority vote"),
    (tpv.ReinforcePPConfig, {}, "no group baseline"),
])
def test_estimators_without_a_group_refuse_with_the_reason(tmp_path, config, overrides, reason):
    for mode in ("speed", "greso", "dynamic_sampling"):
        with pytest.raises(ValueError, match=rf"^prompt_selection: expected 'none' for {config.__name__} \(.*{reason}"):
            toy_args(config, tmp_path, prompt_selection=mode, **overrides)


@pytest.mark.parametrize("config, overrides", [
    (tpv.GRPOConfig, {}), (tpv.RLOOConfig, {}), (tpv.ReinforcePPConfig, {"baseline": True}), (tpv.DAPOConfig, {}),
    (tpv.ProcessGRPOConfig, {}),
])
def test_group_estimators_take_every_mode(tmp_path, config, overrides):
    for mode in screening.SELECTION_MODES:
        args = toy_args(config, tmp_path, prompt_selection=mode, **overrides)
        assert args.selection_mode() == (mode if mode != "none" or config is not tpv.DAPOConfig else
                                         "dynamic_sampling")
    assert toy_args(config, tmp_path, prompt_selection="speed", **overrides).screening_size() == 2  # G = 4


@pytest.mark.parametrize("field, value, overrides", [
    ("prompt_selection", "speedy", {}),
    ("screening_num_generations", 4, {"prompt_selection": "speed"}),  # = num_generations: nothing left to complete
    ("screening_num_generations", 1, {"prompt_selection": "speed"}),  # one sample never shows a spread
    ("num_generations", 2, {"prompt_selection": "speed", "per_device_train_batch_size": 4}),
    ("max_generation_rounds", 1, {"prompt_selection": "speed"}),  # screen, then complete: 2 rounds at least
    ("greso_exploration_init", 0.99, {}),
    ("greso_exploration_min", 0.0, {}),
    ("greso_exploration_step", 1.0, {}),
    ("greso_target_zero_variance", 1.5, {}),
    ("kl_in_reward_coef", 0.1, {}),  # GRPO's KL is the loss term
])
def test_bad_selection_config_names_the_field(tmp_path, field, value, overrides):
    with pytest.raises(ValueError, match=rf"^{field}: expected"):
        toy_args(tpv.GRPOConfig, tmp_path, **{field: value, **overrides})


# ------------------------------------------------------------------------------------------------ GRPO
def test_grpo_trainer_is_trl_grpo_with_every_new_field_at_its_default(tmp_path, toy_model_dir):
    """trl_ppo_variants.GRPOTrainer with its defaults trains bit-identically to trl.GRPOTrainer (2 steps)."""
    import trl

    weights = []
    for name, config, trainer_cls in [("trl", trl.GRPOConfig, trl.GRPOTrainer),
                                      ("ours", tpv.GRPOConfig, tpv.GRPOTrainer)]:
        args = toy_args(config, tmp_path / name, max_steps=2, gradient_accumulation_steps=2, steps_per_generation=4)
        trainer = trainer_cls(toy_model_dir, addition_reward, args=args, train_dataset=addition_dataset(64, seed=0))
        trainer.train()
        weights.append(modules_state(trainer))
    assert weights[0].keys() == weights[1].keys()
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert tpv.GRPOTrainer(toy_model_dir, addition_reward, args=toy_args(tpv.GRPOConfig, tmp_path),
                           train_dataset=addition_dataset(8, seed=0)).prompt_selection is None


# ------------------------------------------------------------------------------------------------ advantages
def _capture_batches(trainer):
    batches = []
    original = trainer._generate_and_score_completions

    def wrapped(inputs):
        out = original(inputs)
        batches.append({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in out.items()})
        return out

    trainer._generate_and_score_completions = wrapped
    return batches


ESTIMATORS = {
    # name -> (config, trainer, overrides, trainer kwargs, expected advantages of (rewards (N,), mask (N, T), G))
    "grpo": (tpv.GRPOConfig, tpv.GRPOTrainer, {}, {}, lambda r, m, g: grpo_advantages(r, g)),
    "rloo": (tpv.RLOOConfig, tpv.RLOOTrainer, {"beta": 0.0}, {}, lambda r, m, g: rloo_advantages(r, g)),
    "reinforce_pp_baseline": (tpv.ReinforcePPConfig, tpv.ReinforcePPTrainer, {"baseline": True}, {},
                              lambda r, m, g: reinforce_pp_baseline_advantages(r, m, g)),
    "dapo": (tpv.DAPOConfig, tpv.DAPOTrainer, {"overlong_penalty": False}, {},
             lambda r, m, g: grpo_advantages(r, g)),
    # one step per completion, ending at its last token (process GRPO's step path)
    "process_grpo": (tpv.ProcessGRPOConfig, tpv.ProcessGRPOTrainer, {},
                     {"step_reward_funcs": [outcome_as_one_step(addition_reward)]},
                     lambda r, m, g: grpo_process_advantages(r.unsqueeze(1), (m.sum(1) - 1).unsqueeze(1), m, g)),
}


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_a_screened_and_completed_group_gets_the_advantages_of_one_group(tmp_path, toy_model_dir, toy_tokenizer,
                                                                         name):
    """SPEED: every trained group is made of its screening completions (an earlier generate call) and its other
    completions (a later one). Scoring the trained rows again as plain groups of G, with the estimator's own pure
    function, gives exactly the advantages the trainer used."""
    config, trainer_cls, overrides, kwargs, expected = ESTIMATORS[name]
    args = toy_args(config, tmp_path, max_steps=2, prompt_selection="speed", temperature=1.5, **overrides)
    rewards = None if name == "process_grpo" else addition_reward
    trainer = trainer_cls(toy_model_dir, rewards, args=args, train_dataset=addition_dataset(64, seed=0), **kwargs)
    batches = _capture_batches(trainer)
    trainer.train()
    G = args.num_generations
    prefix = trainer.selection_metric_prefix
    logs = [h for h in trainer.state.log_history if f"{prefix}/rounds" in h]
    assert logs and all(h[f"{prefix}/rounds"] >= 2 and h[f"{prefix}/exhausted"] == 0 for h in logs)
    for batch in batches:
        prompts = toy_tokenizer.batch_decode(batch["prompt_ids"], skip_special_tokens=True)
        completions = toy_tokenizer.batch_decode(batch["completion_ids"], skip_special_tokens=True)
        assert all(len(set(prompts[i:i + G])) == 1 for i in range(0, len(prompts), G))
        r = torch.tensor(addition_reward(completions, [addition_answer(p) for p in prompts]))
        assert (r.view(-1, G).std(dim=1) > 0).all()  # every trained group has a spread
        mask = batch["completion_mask"].float()
        want = expected(r, mask, G)
        assert torch.equal(batch["advantages"], want.to(batch["advantages"].dtype)), name


def test_kl_in_the_reward_travels_with_the_screened_rows(tmp_path, toy_model_dir):
    """RLOO's KL penalty (beta > 0): every round computes its rows' KL, which follows them into the batch."""
    args = toy_args(tpv.RLOOConfig, tmp_path, max_steps=2, prompt_selection="speed+greso", beta=0.05)
    trainer = tpv.RLOOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=addition_dataset(64, seed=0))
    seen = []
    compute = trainer.compute_advantages

    def spy(rewards, batch, group_size):
        seen.append(batch)
        return compute(rewards, batch, group_size)

    trainer.compute_advantages = spy
    batches = _capture_batches(trainer)
    trainer.train()
    assert seen and all(b is not None and b["kl_in_reward"].shape == b["completion_mask"].shape for b in seen)
    assert all("kl_in_reward" not in b and torch.isfinite(b["advantages"]).all() for b in batches)
    assert any(h.get("kl_in_reward", 0) > 0 for h in trainer.state.log_history)


# ------------------------------------------------------------------------------------------------ the loop
def _round_calls(monkeypatch):
    from trl import GRPOTrainer

    calls = []
    original = GRPOTrainer._generate_and_score_completions

    def spy(self, inputs):
        calls.append((self.num_generations, [x["prompt"] for x in inputs]))
        return original(self, inputs)

    monkeypatch.setattr(GRPOTrainer, "_generate_and_score_completions", spy)
    return calls


def test_speed_batches_screening_and_completion_in_one_generate_call(tmp_path, toy_model_dir, monkeypatch):
    """G = 6, N_init = 2: TRL is called with num_generations = gcd(2, 6) = 2 (2-row blocks of one prompt, what vLLM
    server mode needs); a later round completes the accepted prompts (4 rows each) together with new screenings."""
    args = toy_args(tpv.GRPOConfig, tmp_path, max_steps=3, num_generations=6, per_device_train_batch_size=12,
                    prompt_selection="speed", screening_num_generations=2, temperature=1.5)
    trainer = tpv.GRPOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=addition_dataset(64, seed=0))
    calls = _round_calls(monkeypatch)
    batches = _capture_batches(trainer)
    trainer.train()
    assert all(block == 2 for block, _ in calls)
    for _, prompts in calls:
        assert len(prompts) % 2 == 0 and all(prompts[i] == prompts[i + 1] for i in range(0, len(prompts), 2))
    # a call holding both a screening (2 rows) and a completion (4 rows)
    runs = [[len(list(g)) for _, g in __import__("itertools").groupby(p)] for _, p in calls]
    assert any(2 in r and 4 in r for r in runs), runs
    assert all(b["completion_ids"].shape[0] == 12 for b in batches)
    logs = [h for h in trainer.state.log_history if "selection/rounds" in h]
    assert all(h["selection/prompts_accepted"] >= h["selection/groups_kept"] == 2 for h in logs)
    assert all(0 <= h["frac_reward_zero_std"] <= 1 for h in trainer.state.log_history if "frac_reward_zero_std" in h)


class _FakeVLLM:
    """TRL's `VLLMGeneration` contract, without vLLM: server mode asks the server for `num_generations` samples of
    each unique prompt `prompts[::num_generations]` (so each block of `num_generations` rows must be one prompt);
    colocate mode samples every row on its own. Completions are random digits (a reward spread), then EOS."""

    def __init__(self, mode, eos):
        self.mode, self.eos, self.calls = mode, eos, []
        self.gen = torch.Generator().manual_seed(0)

    def sync_weights(self):
        pass

    def generate(self, prompts, images, num_generations, profiler=None):
        self.calls.append((len(prompts), num_generations))
        n = num_generations if self.mode == "server" else 1
        unique = prompts[::n]
        assert [p for p in unique for _ in range(n)] == prompts, "a block of rows holds several prompts"
        ids = [[int(d) for d in torch.randint(4, 14, (2,), generator=self.gen)] + [self.eos] for _ in prompts]
        return prompts, ids, [[[-1.0]] * len(x) for x in ids], None


@pytest.mark.parametrize("mode", ["server", "colocate"])
def test_screening_rounds_through_a_vllm_stub(tmp_path, toy_model_dir, mode):
    """vLLM (stubbed: not installed here): every SPEED round reaches the backend as blocks of gcd(N_init, G) rows of
    one prompt, which server mode requires; training goes on with full batches."""
    args = toy_args(tpv.GRPOConfig, tmp_path, max_steps=2, num_generations=6, per_device_train_batch_size=12,
                    prompt_selection="speed", screening_num_generations=2)
    trainer = tpv.GRPOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=addition_dataset(64, seed=0))
    fake = _FakeVLLM(mode, trainer.processing_class.eos_token_id)
    trainer.use_vllm, trainer.vllm_mode, trainer.vllm_generation = True, mode, fake
    trainer.vllm_importance_sampling_correction, trainer._last_loaded_step = False, -1
    batches = _capture_batches(trainer)
    trainer.train()
    assert len(fake.calls) >= 4 and all(n == 2 for _, n in fake.calls)  # 2 steps, screening then completion
    assert any(rows % 6 for rows, _ in fake.calls)  # a round that is not whole groups of 6 (screenings of 2)
    assert all(b["completion_ids"].shape[0] == 12 for b in batches)


def test_greso_skips_prompts_with_a_no_spread_history(tmp_path, toy_model_dir):
    """A reward that is always 1 on prompts starting with '1': after their first all-correct group they are skipped
    with probability 1 - p_easy^z; the skips, the history and the exploration probabilities are logged."""

    def ones_easy(completions, prompts, answer, **kwargs):
        real = addition_reward(completions, answer)
        return [1.0 if p.startswith("1") else r for r, p in zip(real, prompts)]

    args = toy_args(tpv.GRPOConfig, tmp_path, max_steps=8, prompt_selection="greso", temperature=1.5)
    trainer = tpv.GRPOTrainer(toy_model_dir, ones_easy, args=args, train_dataset=addition_dataset(64, seed=0))
    trainer.train()
    sel = trainer.prompt_selection
    logs = [h for h in trainer.state.log_history if "selection/prompts_skipped" in h]
    assert sum(h["selection/prompts_skipped"] for h in logs) > 0
    easy = [k for k, v in sel.history.items() if v > 0]
    assert easy  # prompts with all-correct streaks
    assert all(h["selection/greso_p_easy"] <= 0.5 + 1e-9 for h in logs)  # 1/3 of 25% easy is exceeded here
    assert sel.p_easy < 0.5


def test_one_data_set_of_duplicates_shares_the_history(tmp_path, toy_model_dir):
    """addition_dataset(256) holds the 25 sums many times over: the history has at most 25 keys, one per prompt and
    answer, however many epochs and duplicates pass."""
    args = toy_args(tpv.GRPOConfig, tmp_path, max_steps=6, prompt_selection="greso")
    trainer = tpv.GRPOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=addition_dataset(256, seed=0))
    trainer.train()
    assert 0 < len(trainer.prompt_selection.history) <= 25


def test_iterable_dataset_refills_from_the_stream(tmp_path, toy_model_dir, toy_dataset):
    """Issue 22 item 5: DAPO's default dynamic sampling (and every selection mode) on an `IterableDataset` refills
    from the next records of the stream (it used to refuse: "refills need indexing")."""
    for mode in ("dynamic_sampling", "speed+greso"):
        args = toy_args(tpv.DAPOConfig, tmp_path / mode, max_steps=3, prompt_selection=mode)
        trainer = tpv.DAPOTrainer(toy_model_dir, addition_reward, args=args,
                                  train_dataset=toy_dataset.to_iterable_dataset())
        assert isinstance(trainer.prompt_selection.source, screening.StreamPrompts)
        batches = _capture_batches(trainer)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "dapo/rounds" in h]
        assert len(logs) == 3 and any(h["dapo/rounds"] > 1 for h in logs)
        assert trainer.prompt_selection.source.offset > 0  # refills came from the stream
        assert all(b["completion_ids"].shape[0] == 8 and torch.isfinite(b["advantages"]).all() for b in batches)


def test_resume_reproduces_the_uninterrupted_run_with_screening_and_history(tmp_path, toy_model_dir):
    """SPEED + GRESO: a run checkpointed at step 3 and resumed equals the uninterrupted 4-step run (every logged
    metric after step 3, the weights, the refill position, the keep-rate estimate, GRESO's history and exploration
    probabilities)."""
    def make(out, callbacks=None):
        args = toy_args(tpv.GRPOConfig, tmp_path, output_dir=str(tmp_path / out), max_steps=4, save_strategy="steps",
                        save_steps=3, prompt_selection="speed+greso", temperature=1.5)
        return tpv.GRPOTrainer(toy_model_dir, addition_reward, args=args, train_dataset=addition_dataset(64, seed=0),
                               callbacks=callbacks)

    full = make("full")
    full.train()
    stopped = make("stopped", callbacks=[StopAt(3)])
    stopped.train()
    resumed = make("stopped")
    resumed.train(resume_from_checkpoint=True)
    assert full.prompt_selection.history and full.prompt_selection.state_dict() == resumed.prompt_selection.state_dict()
    logs_a, logs_b = step_logs(full), step_logs(resumed)
    assert logs_a[4] == logs_b[4] and "selection/prompts_skipped" in logs_a[4]
    wa, wb = modules_state(full), modules_state(resumed)
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


# ------------------------------------------------------------------------------------------------ learning
def _mixed_difficulty_reward(completions, prompts, answer, **kwargs):
    """The toy reward on a data set of mixed difficulty: prompts starting with 0 or 1 are already solved (always 1),
    those starting with 4 cannot be solved (always 0): 60% of the groups teach nothing, as in a real data set
    dominated by too-easy and too-hard prompts. The sums starting with 2 or 3 are learned."""
    real = addition_reward(completions, answer)
    return [1.0 if p[0] in "01" else 0.0 if p[0] == "4" else r for r, p in zip(real, prompts)]


@torch.no_grad()
def _learnable_accuracy(model, tokenizer, temperature, n=48, seed=0):
    """Accuracy of `n` samples per learnable prompt (2+b, 3+b) at the training temperature; the RNG is restored."""
    from trl_ppo_variants.toy import addition_examples

    state = torch.get_rng_state()
    torch.manual_seed(seed)
    examples = [e for e in addition_examples(4) if e["prompt"][0] in "23"]
    enc = tokenizer([e["prompt"] for e in examples], return_tensors="pt", padding=True, padding_side="left")
    was_training = model.training
    model.eval()
    out = model.generate(**enc, max_new_tokens=3, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                         num_return_sequences=n, pad_token_id=tokenizer.pad_token_id)
    model.train(was_training)
    torch.set_rng_state(state)
    texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return sum(addition_reward(texts, [e["answer"] for e in examples for _ in range(n)])) / len(texts)


def _learning_run(tmp_path, toy_model_dir, seed, mode, steps, stop_at=None):
    """GRPO (G = 16, 4 prompts a step, T = 0.7, lr 5e-4) on the mixed-difficulty data; with `stop_at` (an accuracy),
    evaluated every 5 steps and stopped once it is reached. -> (final accuracy, generated tokens, curve)."""
    from transformers import TrainerCallback

    temperature = 0.7
    args = toy_args(tpv.GRPOConfig, tmp_path / f"{mode}{seed}", max_steps=steps, seed=seed, num_generations=16,
                    per_device_train_batch_size=64, learning_rate=5e-4, lr_scheduler_type="constant",
                    temperature=temperature, max_completion_length=3, prompt_selection=mode)
    trainer = tpv.GRPOTrainer(toy_model_dir, _mixed_difficulty_reward, args=args,
                              train_dataset=addition_dataset(512, seed=seed))
    generated = [0]
    original = trainer._generate_single_turn

    def counted(*a, **k):  # every generate call, screenings included
        ids, logprobs = original(*a, **k)
        generated[0] += sum(len(x) for x in ids)
        return ids, logprobs

    trainer._generate_single_turn = counted
    curve = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
            if stop_at is not None and state.global_step % 5 == 0:
                curve.append((generated[0], _learnable_accuracy(model, processing_class, temperature)))
                control.should_training_stop = curve[-1][1] >= stop_at

    trainer.add_callback(Watch())
    trainer.train()
    return _learnable_accuracy(trainer.model, trainer.processing_class, temperature), generated[0], curve


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_screening_reaches_grpos_accuracy_with_fewer_generated_tokens(tmp_path, toy_model_dir):
    """Plain GRPO trains 40 steps on a data set where 60% of the prompts are already solved or unsolvable; GRPO +
    SPEED (N_init = 4 of G = 16) trains until it reaches plain GRPO's final accuracy. Tokens SPEED needed / plain
    GRPO's (measured, first evaluation at or above it, every 5 steps), seeds 0-7: 0.58, 1.08, 0.63, 0.99, 1.08, 0.65,
    0.42, 0.22 (mean 0.70, median 0.64) on 2026-12-05's CPU (AVX-512 with AMX); on 2026-12-04's seeds 0-5 gave 0.61,
    0.40, 0.63, 1.01, 1.08, 0.62: the trajectories follow the CPU's rounding, seed 1's most. Single seeds above 1 occur
    on both, so the test asserts over the 8 seeds a mean and a median <= 0.8. On the plain toy data (pass rates all
    between 0.25 and 0.85: nearly every screening passes) SPEED does not pay: 1.01 and 1.21 of GRPO's tokens (README,
    "Prompt selection")."""
    ratios = []
    for seed in range(8):
        plain_acc, plain_tokens, _ = _learning_run(tmp_path, toy_model_dir, seed, "none", 40)
        speed_acc, speed_tokens, curve = _learning_run(tmp_path, toy_model_dir, seed, "speed", 40, stop_at=plain_acc)
        reached = next((tokens for tokens, acc in curve if acc >= plain_acc), math.inf)
        ratios.append(reached / plain_tokens)
        print(f"seed {seed}: GRPO {plain_acc:.3f} after {plain_tokens} tokens; SPEED reached it after {reached} "
              f"({ratios[-1]:.2f}x): {curve}")
    median = sorted(ratios)[len(ratios) // 2 - 1 : len(ratios) // 2 + 1]
    assert sum(ratios) / len(ratios) <= 0.8 and sum(median) / 2 <= 0.8, ratios


def test_keys_of_image_rows_follow_the_pixels():
    """GRESO's history key and the refills' prompt key of a VLM row: the same question about another image is another
    prompt; the same image read again (another object, another address in its repr) is the same."""
    from PIL import Image

    red, blue = Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))
    prompt = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Colour?"}]}]
    row = {"prompt": prompt, "image": red, "answer": "red"}
    again = {"prompt": prompt, "image": red.copy(), "answer": "red"}
    other = {"prompt": prompt, "image": blue, "answer": "red"}
    assert screening.row_key(row) == screening.row_key(again) != screening.row_key(other)
    assert screening.prompt_key(row) == screening.prompt_key(again) != screening.prompt_key(other)
    inline = {"prompt": [{"role": "user", "content": [{"type": "image", "image": red}]}]}  # an image in a message
    assert screening.prompt_key(inline) == screening.prompt_key(
        {"prompt": [{"role": "user", "content": [{"type": "image", "image": red.copy()}]}]})
    several = [{"prompt": prompt, "images": [red, blue]}, {"prompt": prompt, "images": [blue, red]}]
    assert screening.prompt_key(several[0]) != screening.prompt_key(several[1])
    # text rows keep their keys (GRESO histories saved before stay valid)
    assert screening.prompt_key({"prompt": "1+2="}) == repr("1+2=")


def _nothing(completions, **kwargs):
    return [None] * len(completions)


@pytest.mark.timeout(300)
def test_unscorable_screenings_count_their_prompts_once(tmp_path, toy_model_dir):
    """G = 4, N_init = 3: TRL scores a SPEED round in blocks of gcd(3, 4) = 1 row, and the unscorable-run guard
    counted rows / block prompts, each screened prompt 3 times (10 prompts reported as "30 prompts"), so that it
    stopped below `min_unscorable_prompts`. It counts the screened prompts now."""
    args = toy_args(tpv.GRPOConfig, tmp_path, max_steps=2, prompt_selection="speed", screening_num_generations=3,
                    max_unscorable_batches=1, min_unscorable_prompts=1)
    trainer = tpv.GRPOTrainer(toy_model_dir, _nothing, args=args, train_dataset=addition_dataset(64, seed=0))
    with pytest.raises(RuntimeError) as err:
        trainer.train()
    found = re.match(r"no completion got a finite reward in 1 consecutive generation batches \((\d+) prompts\)",
                     str(err.value))
    assert found, str(err.value)
    prompts = int(found.group(1))
    assert trainer.scoring_tally["completions"] == 3 * prompts  # each screened with 3 completions


def test_a_screening_and_its_completion_are_one_unscorable_prompt(tmp_path, toy_model_dir):
    """Consecutive unscorable batches count distinct prompts: a completion of a prompt screened in the same run of
    unscorable batches adds nothing; a scored batch starts the count again."""
    args = toy_args(tpv.GRPOConfig, tmp_path, prompt_selection="speed", screening_num_generations=3,
                    max_unscorable_batches=None)
    trainer = tpv.GRPOTrainer(toy_model_dir, _nothing, args=args, train_dataset=addition_dataset(64, seed=0))
    trainer.model.train()
    unscored = torch.full((6, 1), float("nan"))
    tally = trainer.scoring_tally
    trainer.track_scorable(unscored, 1, prompts=[(0, 0), (0, 1)])  # two screenings of 3 rows
    assert tally["consecutive"] == 1 and tally["consecutive_prompts"] == 2
    trainer.track_scorable(unscored[:4], 1, prompts=[(0, 1), (0, 2)])  # a completion (1 row) and a screening
    assert tally["consecutive"] == 2 and tally["consecutive_prompts"] == 3
    trainer.track_scorable(torch.ones(4, 1), 1, prompts=[(0, 3)])
    assert tally["consecutive"] == tally["consecutive_prompts"] == 0
    trainer.track_scorable(unscored[:1], 1, prompts=[(0, 1)])  # a new run of unscorable batches
    assert tally["consecutive"] == tally["consecutive_prompts"] == 1
    trainer.track_scorable(unscored, 3)  # whole groups: rows / group size
    assert tally["consecutive_prompts"] == 3
