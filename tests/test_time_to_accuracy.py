"""The time-to-accuracy benchmark (`bench/time_to_accuracy.py`): its cheap parts on hand-made inputs, every method's
config with the demo's settings, and the whole protocol end to end on the toy model (seconds, not the real model)."""

import json
import math
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import time_to_accuracy as tta  # noqa: E402


def test_the_clock_leaves_evaluations_out():
    now = [0.0]
    clock = tta.TrainClock(timer=lambda: now[0])
    clock.start()
    now[0] = 10.0
    with clock.evaluating():
        now[0] = 45.0  # a 35 s evaluation
    now[0] = 50.0
    assert clock.now() == 15.0
    with clock.evaluating():
        now[0] = 80.0
    assert clock.now() == 15.0


def test_eval_schedules():
    # the reference: a step grid
    assert [s for s in range(1, 21) if tta.eval_schedule(s, 0.0, every_steps=5)] == [5, 10, 15, 20]
    # the others: the first step end past each multiple of budget / points
    assert not tta.eval_schedule(3, 9.9, every_s=10.0, done=0)
    assert tta.eval_schedule(4, 10.2, every_s=10.0, done=0)
    assert not tta.eval_schedule(5, 15.0, every_s=10.0, done=1)
    assert tta.eval_schedule(7, 31.0, every_s=10.0, done=1)  # a late step: one evaluation, then the grid goes on


def test_time_to_reach_is_the_first_evaluation_at_the_target():
    curve = [(0.0, 0.30), (50.0, 0.35), (100.0, 0.42), (150.0, 0.40), (200.0, 0.45)]
    assert tta.time_to_reach(curve, 0.42) == 100.0
    assert tta.time_to_reach(curve, 0.30) == 0.0
    assert math.isinf(tta.time_to_reach(curve, 0.5))


def test_summary_and_table():
    rows = [
        {"method": "grpo", "label": "trl.GRPOTrainer", "curve": [(0.0, 0.3), (100.0, 0.4), (200.0, 0.5)],
         "train_seconds": 200.0, "steps": 20, "gen_per_trained_token": 1.0},
        {"method": "grpo_speed", "label": "GRPO + screening (SPEED)", "curve": [(0.0, 0.3), (90.0, 0.52),
                                                                             (201.0, 0.6)],
         "train_seconds": 201.0, "steps": 12, "gen_per_trained_token": 1.6},
        {"method": "ppo", "label": "PPO", "curve": [(0.0, 0.3), (205.0, 0.35)], "train_seconds": 205.0, "steps": 9,
         "gen_per_trained_token": 1.0},
    ]
    summary = tta.summarize(rows)
    assert summary == {"target": 0.5, "budget_s": 200.0}
    assert rows[0]["time_ratio"] == 1.0 and rows[1]["time_ratio"] == pytest.approx(0.45)
    assert rows[1]["acc_at_budget"] == 0.6 and math.isinf(rows[2]["time_to_target"])
    table = tta.format_table(rows, summary["target"], summary["budget_s"], 20)
    assert "90 s (0.45x)" in table and "not reached" in table and "| GRPO + screening (SPEED)" in table
    assert "time to 0.500 (GRPO's 20-step acc.)" in table


def test_methods_reference_first_and_unknown_names_refused():
    assert [m.name for m in tta.select_methods(None)] == list(tta.DEFAULT_METHODS)
    assert [m.name for m in tta.select_methods("dapo_speed,grpo")] == ["grpo", "dapo_speed"]
    assert [m.name for m in tta.select_methods("rloo")] == ["grpo", "rloo"]
    with pytest.raises(ValueError, match="--methods: unknown"):
        tta.select_methods("grpo,speedy")


@pytest.mark.parametrize("name", list(tta.METHODS))
def test_every_method_builds_its_config_with_the_demos_settings(tmp_path, name):
    from trl_ppo_variants.demo import COMMON

    method = tta.METHODS[name]
    config_cls, _ = tta.trainer_classes(method)
    args = config_cls(**{**COMMON, **method.settings}, output_dir=str(tmp_path), max_steps=2)
    assert (args.num_generations, args.max_completion_length, args.temperature) == (4, 24, 0.7)
    mode = method.settings.get("prompt_selection")
    if mode:
        assert args.selection_mode() == mode


def test_a_larger_group_keeps_four_prompts_a_step(monkeypatch):
    import trl_ppo_variants.smollm2 as smollm2

    monkeypatch.setattr(smollm2, "smollm2_checkpoint", lambda: "unused")
    assert tta.smollm2_task(0, 2, 1, train_size=4).common["per_device_train_batch_size"] == 16
    task = tta.smollm2_task(0, 2, 1, train_size=4, num_generations=16)
    assert (task.common["num_generations"], task.common["per_device_train_batch_size"]) == (16, 64)


def test_the_protocol_end_to_end_on_the_toy_model(tmp_path, toy_model_dir):
    """The reference trains 2 steps (its time is the budget), GRPO + SPEED trains until its clock passes it; the JSON,
    the table and the plot are written; the curves start at the shared accuracy before training."""
    from trl_ppo_variants.toy import addition_dataset, addition_examples, addition_reward

    examples = addition_examples(4)

    def evaluate(model, tokenizer):
        import torch

        enc = tokenizer([e["prompt"] for e in examples], return_tensors="pt", padding=True, padding_side="left")
        with torch.random.fork_rng(), torch.no_grad():
            torch.manual_seed(0)
            out = model.generate(**enc, max_new_tokens=3, do_sample=True, pad_token_id=tokenizer.pad_token_id)
        texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
        return sum(addition_reward(texts, [e["answer"] for e in examples])) / len(examples)

    common = dict(per_device_train_batch_size=8, num_generations=4, max_completion_length=3, learning_rate=1e-3,
                  temperature=1.0, beta=0.0, report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    task = tta.Task(toy_model_dir, addition_dataset(64, seed=0), addition_reward, evaluate, common, "toy")
    out = tmp_path / "results"
    result = tta.run_benchmark(task, tta.select_methods("grpo_speed"), grpo_steps=2, eval_points=2, seed=0,
                               out=str(out), progress=lambda s: None)
    saved = json.loads((out / "time_to_accuracy.json").read_text())
    assert [r["method"] for r in saved["rows"]] == ["grpo", "grpo_speed"] and not saved["failed"]
    ref, speed = saved["rows"]
    assert ref["steps"] == 2 and len(ref["curve"]) == 3  # before, step 1, step 2
    assert all(r["curve"][0] == [0.0, saved["before"]] for r in saved["rows"])
    assert speed["curve"][-1][0] >= saved["budget_s"] or speed["steps"] == 6  # the budget, or 3x the steps
    assert speed["gen_tokens"] > 0 and speed["gen_per_trained_token"] >= 1.0
    assert saved["target"] == ref["curve"][-1][1] and "machine" in saved
    assert (out / "time_to_accuracy.md").read_text().startswith("| method")
    import importlib.util

    assert (out / "time_to_accuracy.png").exists() or importlib.util.find_spec("matplotlib") is None
    assert result["table"].count("\n") == 3
