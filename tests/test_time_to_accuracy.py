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


def test_the_work_clock_is_cpu_time_in_probe_units():
    work = tta.WorkClock()
    assert work.step(10.0, 0.5) == 20.0  # 10 s of CPU at a probe of 0.5 s
    assert work.step(25.0, 0.5) == 50.0
    assert work.step(40.0, 1.0) == 65.0  # the next 15 s ran at half the speed: half the work per second


def test_the_probe_is_a_fixed_forward_that_leaves_the_model_as_it_was(toy_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir)
    model.train()
    probe = tta.SpeedProbe(model, vocab_size=50, rows=2, tokens=8)
    state = torch.get_rng_state()
    out = probe.measure()
    assert out["probe_cpu_s"] > 0 and out["probe_wall_s"] > 0 and model.training
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(probe.ids, tta.SpeedProbe(model, vocab_size=50, rows=2, tokens=8).ids)


def test_the_held_out_measure_decodes_what_plain_generation_decodes(toy_model_dir):
    """The prompt's cache computed once and repeated for its samples (under either name transformers gives it), in
    batches of left-padded prompts: greedy, every sample is the completion `generate` gives the prompt alone."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(toy_model_dir)
    tokenizer = AutoTokenizer.from_pretrained(toy_model_dir)
    prompts = ["1+2=", "13+4=", "2+22=", "103+7=", "3+3="]
    model.train()
    seen = []

    def reward(completions, answer):
        seen.extend(completions)
        return [1.0 if c.startswith(a) else 0.0 for c, a in zip(completions, answer)]

    alone = []
    for p in prompts:
        enc = tokenizer(p, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        alone.append(tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    answers = [alone[0], "x", alone[2], alone[3], "y"]
    correct = tta.sampled_correct(model, tokenizer, prompts, answers, samples=2, temperature=1.0, max_new_tokens=3,
                                  seed=0, reward=reward, questions_per_batch=2, do_sample=False)
    assert seen == [c for c in alone for _ in range(2)]
    assert correct == [2, 0, 2, 2, 0] and model.training


def test_the_reference_evaluates_on_a_step_grid():
    assert [s for s in range(1, 21) if tta.step_grid_due(s, 5)] == [5, 10, 15, 20]


def test_the_others_evaluate_at_the_last_step_end_before_each_point_and_stop_nearest_the_budget():
    points = tta.time_grid(100.0, 4)
    assert points == [25.0, 50.0, 75.0, 100.0]
    assert tta.grid_action(10.0, 10.0, points) == (0, False)
    assert tta.grid_action(20.0, 10.0, points) == (1, False)  # the next step end (30) would pass 25
    assert tta.grid_action(40.0, 10.0, points) == (1, False)  # the next one ends at 50, still at or before 50
    assert tta.grid_action(50.0, 10.0, points) == (2, False)
    assert tta.grid_action(94.0, 10.0, points) == (3, False)  # the next step end (104) is nearer the budget than 94
    assert tta.grid_action(96.0, 10.0, points) == (4, True)   # 96 is nearer 100 than 106 is
    assert tta.grid_action(56.0, 30.0, points) == (3, False)  # long steps: one evaluation stands for 25, 50 and 75
    assert tta.grid_action(120.0, 10.0, points) == (4, True)


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


@pytest.mark.parametrize("name", ["grpo_server", "grpo_async", "dapo_server", "dapo_async", "dapo_async_batch"])
def test_the_server_methods_generate_on_the_benchmarks_server(tmp_path, name):
    """Issue 42's rows: on the server, overlapped or not; DAPO with its own over-sampling, or its first round held
    to the dataloader's batch (`dapo_async_batch`). A server method without a server is a clear error."""
    method = tta.METHODS[name]
    assert tta.uses_server(method) and not tta.uses_server(tta.METHODS["grpo"])
    args = tta.trainer_classes(method)[0](**method.settings, use_cpu=True, output_dir=str(tmp_path), max_steps=2)
    assert (args.use_vllm, args.vllm_mode, args.max_staleness) == (True, "server", int("_async" in name))
    if name.startswith("dapo"):
        assert args.max_oversample_factor == (1.0 if name.endswith("_batch") else 2.0)
    task = tta.Task("unused", None, None, None, {})
    with pytest.raises(ValueError, match=f"method {name}: generates on a vLLM server; expected --server-url"):
        tta.run_method(method, task, steps=2, seed=0, output_dir=str(tmp_path), budget_s=None, eval_points=1,
                       before=0.0)


def test_no_server_is_started_for_methods_without_one_or_with_one_named():
    opts = type("Opts", (), {"server_url": None})()
    with tta.benchmark_server(tta.select_methods("dapo"), opts) as url:
        assert url is None
    opts.server_url = "http://127.0.0.1:1"
    with tta.benchmark_server(tta.select_methods("grpo_async"), opts) as url:
        assert url == "http://127.0.0.1:1"
    assert opts.server_url == "http://127.0.0.1:1"


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
    # it stops at the step end nearest the budget (within half a mean step), or at 3x the reference's steps
    last = speed["curve"][-1][0]
    assert last + last / speed["steps"] / 2 >= saved["budget_s"] or speed["steps"] == 6
    assert speed["gen_tokens"] > 0 and speed["gen_per_trained_token"] >= 1.0
    # every step's log: the clocks, the counts, TRL's metrics; the curves on both clocks
    for row in (ref, speed):
        log = row["steps_log"]
        assert [e["step"] for e in log] == list(range(1, row["steps"] + 1))
        assert all(a["clock_cpu"] <= b["clock_cpu"] and a["clock_wall"] <= b["clock_wall"] for a, b in zip(log, log[1:]))
        assert all(0 <= e["effective_sequences"] <= e["trained_sequences"] and "reward" in e for e in log)
        assert sum(e["trained_tokens"] for e in log) == row["trained_tokens"]
        assert sum(e["gen_tokens"] for e in log) == row["gen_tokens"]
        assert all(a["clock_work"] < b["clock_work"] and e["probe_cpu_s"] > 0 for a, b, e in zip(log, log[1:], log))
        assert [t for t, _ in row["curve"]] == [t for t, _ in row["curve_work"]] and row["clock"] == "work"
        assert [e["clock_cpu"] for e in row["evaluations"]] == [t for t, _ in row["curve_cpu"][1:]]
        assert len(row["evaluations"]) == len(row["curve"]) - 1
    assert ref["steps_log"][0]["trained_sequences"] == 8 and speed["steps_log"][0]["effective_sequences"] > 0
    assert saved["target"] == ref["curve"][-1][1] and "machine" in saved
    assert (out / "time_to_accuracy.md").read_text().startswith("| method")
    import importlib.util

    assert (out / "time_to_accuracy.png").exists() or importlib.util.find_spec("matplotlib") is None
    assert result["table"].count("\n") == 3


# ------------------------------------------------------------------------------------------------ several seeds
def test_held_out_standard_error_is_over_questions():
    assert tta.heldout_se([4, 0], 4) == pytest.approx(0.5)  # per question 1 and 0: stdev 0.707 / sqrt(2)
    assert tta.heldout_se([2, 2, 2, 2], 4) == 0.0
    assert tta.heldout_se([1, 3, 2, 2], 4) == pytest.approx(math.sqrt(1 / 24) / 2)  # 0.25 .75 .5 .5: var 1/24
    assert math.isnan(tta.heldout_se([3], 4))
    assert tta.as_evaluation({"acc": 0.5, "correct": [4, 0], "samples": 4})["se"] == pytest.approx(0.5)
    assert tta.as_evaluation(0.25) == {"acc": 0.25}


def test_the_noise_of_a_difference_and_of_a_mean_over_seeds():
    # per-question differences (4-2, 1-1, 3-0, 0-1) / 4 = .5 0 .75 -.25: mean .25, var (0.0625+0.0625+0.25+0.25)/3
    assert tta.paired_se([4, 1, 3, 0], [2, 1, 0, 1], 4) == pytest.approx(math.sqrt(0.625 / 3) / 2)
    assert tta.paired_se([4, 0], [4, 0], 4) == 0.0  # the same answers: no noise in the difference
    assert math.isnan(tta.paired_se([4, 0], [4, 0, 1], 4)) and math.isnan(tta.paired_se([1], [2], 4))
    assert tta.noise_of_mean([0.03, 0.04]) == pytest.approx(0.025)  # sqrt(0.0009 + 0.0016) / 2
    assert math.isnan(tta.noise_of_mean([0.03, math.nan]))
    ref = {**REF, "evaluations": [{"acc": 0.4, "correct": [2, 1, 0, 1], "samples": 4, "se": 0.1}]}
    row = {"curve": [[0.0, 0.1], [98.0, 0.5]], "train_seconds": 98.0, "steps": 10,
           "evaluations": [{"acc": 0.5, "correct": [4, 1, 3, 0], "samples": 4, "se": 0.2}]}
    m = tta.seed_metrics(ref, row)
    assert m["se_at_budget"] == 0.2 and m["diff_se"] == pytest.approx(math.sqrt(0.625 / 3) / 2)
    assert math.isnan(tta.seed_metrics(REF, row)["diff_se"])  # a reference without per-question scores


def test_percentile_bounds_and_the_exact_bootstrap():
    assert tta.quantile_bounds([0.0, 0.5, 0.5, 1.0], 0.5) == (0.5, 0.5)
    assert tta.quantile_bounds([0.0, 0.5, 0.5, 1.0], 0.9) == (0.0, 1.0)
    # two values: the 4 ordered resamples have means 0, .5, .5, 1
    assert tta.bootstrap_ci([0.0, 1.0], level=0.5) == (0.5, 0.5)
    assert tta.bootstrap_ci([0.0, 1.0], level=0.9) == (0.0, 1.0)
    # [0, 0, 3]: the number k of 3s in a resample is Binomial(3, 1/3): means 0 (8 of 27), 1 (12), 2 (6), 3 (1);
    # at 80% the bounds are sorted entries floor(2.7) = 2 (a 0) and ceil(24.3) - 1 = 24 (a 2)
    assert tta.bootstrap_ci([0.0, 0.0, 3.0], level=0.8) == (0.0, 2.0)
    assert tta.bootstrap_ci([0.0, 0.0, 3.0], level=0.95) == (0.0, 3.0)
    assert tta.bootstrap_ci([1.0, math.inf], level=0.9) == (1.0, math.inf)  # a target never reached propagates
    # max of a resample of [2, 7, 3]: 2 (1 of 27), 3 (7), 7 (19); at 50% sorted entries floor(6.75) = 6 and 20
    assert tta.bootstrap_ci([2.0, 7.0, 3.0], stat=max, level=0.5) == (3.0, 7.0)
    assert all(math.isnan(x) for x in tta.bootstrap_ci([]))
    # beyond exact_up_to: seeded random resamples, reproducible, and around the right interval
    values = [0.1, 0.4, 0.2, 0.3, 0.5, 0.6, 0.2]
    mc = tta.bootstrap_ci(values, level=0.9, exact_up_to=0, resamples=4000)
    assert mc == tta.bootstrap_ci(values, level=0.9, exact_up_to=0, resamples=4000)
    assert mc[0] < sum(values) / 7 < mc[1] and mc[1] - mc[0] < 0.3


def test_a_curve_read_at_fractions_of_the_budget():
    curve = [(0.0, 0.1), (50.0, 0.3), (100.0, 0.5)]
    assert tta.curve_at(curve, 100.0, [0.0, 0.25, 0.5, 1.0, 1.2]) == pytest.approx([0.1, 0.2, 0.3, 0.5, 0.5])
    assert tta.curve_at([(0.0, 0.1), (90.0, 0.4)], 100.0, [0.45, 1.0]) == pytest.approx([0.25, 0.4])


def test_the_area_under_a_curve_is_its_mean_accuracy_over_the_budget():
    # (0.1 + 0.3) / 2 x 0.5 + (0.3 + 0.5) / 2 x 0.5
    assert tta.curve_auc([(0.0, 0.1), (50.0, 0.3), (100.0, 0.5)], 100.0) == pytest.approx(0.3)
    # stopped at 0.9x: its last accuracy held to the budget, 0.9 x 0.25 + 0.1 x 0.4
    assert tta.curve_auc([(0.0, 0.1), (90.0, 0.4)], 100.0) == pytest.approx(0.265)
    # evaluated past the budget: read at the budget (0.7), the rest left out
    assert tta.curve_auc([(0.0, 0.2), (120.0, 0.8)], 100.0) == pytest.approx(0.45)
    # an early learner and a late one reach 0.5 at the budget alike, with different areas
    early, late = [(0.0, 0.1), (25.0, 0.5), (100.0, 0.5)], [(0.0, 0.1), (75.0, 0.1), (100.0, 0.5)]
    assert tta.curve_auc(early, 100.0) == pytest.approx(0.45) and tta.curve_auc(late, 100.0) == pytest.approx(0.15)


REF = {"curve": [[0.0, 0.1], [50.0, 0.3], [100.0, 0.4]], "train_seconds": 100.0, "steps": 20}


def test_one_seeds_numbers_against_its_reference():
    row = {"curve": [[0.0, 0.1], [24.0, 0.2], [49.0, 0.45], [74.0, 0.5], [98.0, 0.38]], "train_seconds": 98.0,
           "steps": 10, "gen_per_trained_token": 2.5}
    m = tta.seed_metrics(REF, row)
    assert (m["target"], m["budget_s"], m["time_to_target"]) == (0.4, 100.0, 49.0)
    assert m["time_ratio"] == pytest.approx(0.49) and m["reached_by_half"]
    assert m["acc_at_budget"] == 0.38 and m["diff_at_budget"] == pytest.approx(-0.02)
    assert (m["peak"], m["peak_at"], m["final"]) == (0.5, 0.74, 0.38) and m["drop_from_peak"] == pytest.approx(0.12)
    assert m["stop_ratio"] == 0.98 and m["sec_per_step"] == 9.8
    # 0.24 x 0.15 + 0.25 x 0.325 + 0.25 x 0.475 + 0.24 x 0.44 + 0.02 x 0.38; GRPO's 0.1 + 0.175
    assert m["auc"] == pytest.approx(0.3492) and m["diff_auc"] == pytest.approx(0.3492 - 0.275)
    ref = tta.seed_metrics(REF, REF)  # the reference against itself: its target at its end, 1x
    assert ref["time_ratio"] == 1.0 and ref["diff_at_budget"] == 0.0 and not ref["reached_by_half"]
    late = tta.seed_metrics(REF, {**row, "curve": [[0.0, 0.1], [52.0, 0.41], [98.0, 0.3]]})
    assert late["time_ratio"] == 0.52 and not late["reached_by_half"]


def test_means_over_seeds_and_the_goal():
    def metrics(ratio, diff, stop=1.0):
        return {"time_ratio": ratio, "stop_ratio": stop, "reached_by_half": ratio <= 0.5, "acc_at_budget": 0.5 + diff,
                "diff_at_budget": diff, "peak": 0.6, "final": 0.5 + diff, "drop_from_peak": 0.1 - diff,
                "target": 0.5, "steps": 10, "sec_per_step": 2.0, "cpu_per_step": 1.5, "gen_per_trained_token": 1.0,
                "peak_at": 0.5, "auc": 0.4 + diff, "diff_auc": diff}

    s = tta.method_summary([metrics(0.4, 0.1), metrics(0.6, -0.05), metrics(math.inf, 0.0, stop=0.97)])
    assert (s["seeds"], s["reached_by_half"], s["not_reached"]) == (3, 1, 1)
    assert s["time_ratio_median"] == 0.6 and s["time_ratio_median_ci"][1] == math.inf
    assert s["time_ratio_mean"] == pytest.approx((0.4 + 0.6 + 0.97) / 3) and s["time_ratio_mean_is_lower_bound"]
    assert s["diff_at_budget"] == pytest.approx(0.05 / 3)
    assert s["diff_at_budget_ci"] == tta.bootstrap_ci([0.1, -0.05, 0.0])
    assert (s["sec_per_step"], s["cpu_per_step"]) == (2.0, 1.5)
    assert not tta.goal_met(s)
    assert tta.goal_met(tta.method_summary([metrics(0.4, 0.0)] * 4 + [metrics(0.9, 0.0)]))
    assert not tta.goal_met(tta.method_summary([metrics(0.4, 0.0)] * 3 + [metrics(0.9, 0.0)] * 2))
    assert not tta.goal_met(tta.method_summary([metrics(0.4, -0.01)] * 5))
    # fewer than 5 seeds: missed once the rest cannot make 4, else undecided
    assert tta.goal_verdict(tta.method_summary([metrics(0.4, 0.0)] * 4 + [metrics(0.9, 0.0)])) == "MET"
    assert tta.goal_verdict(tta.method_summary([metrics(0.9, 0.0)] * 2)) == "missed"
    assert tta.goal_verdict(tta.method_summary([metrics(0.4, 0.0), metrics(0.9, 0.0)])) == "undecided (2 of 5 seeds)"


def test_variants_seeds_and_the_job_order():
    known = tta.known_methods(["dapo_nopen=dapo:overlong_penalty=False,epsilon_high=0.2",
                               "dapo_lr=dapo_nopen:learning_rate=1e-5,lr_scheduler_type=cosine"])
    v = known["dapo_lr"]
    assert v.algorithm == "dapo" and v.settings == {"overlong_penalty": False, "epsilon_high": 0.2,
                                                     "learning_rate": 1e-5, "lr_scheduler_type": "cosine"}
    assert known["dapo_nopen"].label == "DAPO [overlong_penalty=False, epsilon_high=0.2]"
    assert [m.name for m in tta.select_methods("dapo_lr", known)] == ["grpo", "dapo_lr"]
    for bad, match in [("dapo_x", "expected NAME=BASE"), ("x=nope:a=1", "unknown base"),
                       ("grpo=dapo:beta=0.1", "is the reference"), ("x=dapo:beta", "is not field=value")]:
        with pytest.raises(ValueError, match=match):
            tta.known_methods([bad])
    assert tta.parse_seeds("0-2,5") == [0, 1, 2, 5]
    for bad in ("a", "1,1", ""):
        with pytest.raises(ValueError, match="--seeds"):
            tta.parse_seeds(bad)
    pending = [(0, "grpo"), (0, "dapo"), (1, "grpo"), (1, "dapo")]
    assert tta.next_job(pending, [], lambda s: False) == (0, "grpo")
    assert tta.next_job(pending[1:], [(0, "grpo")], lambda s: False) == (1, "grpo")  # dapo 0 waits for its grpo
    assert tta.next_job(pending[1:], [], lambda s: s == 0) == (0, "dapo")
    assert tta.next_job([(1, "dapo")], [], lambda s: s == 0) is None
    assert tta.job_order([2, 0], ["grpo", "dapo"]) == [(2, "grpo"), (2, "dapo"), (0, "grpo"), (0, "dapo")]
    assert tta.job_order([2, 0], ["grpo", "dapo"], "method") == [(2, "grpo"), (0, "grpo"), (2, "dapo"), (0, "dapo")]


def test_a_running_run_is_adopted_not_restarted(tmp_path):
    import subprocess

    marker = tta.marker_path(str(tmp_path), 3, "dapo")
    assert marker == str(tmp_path / "seed3" / "dapo.running")
    os.makedirs(os.path.dirname(marker))
    assert tta.live_pid(marker) is None  # no marker
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        with open(marker, "w") as f:
            f.write(str(proc.pid))
        assert tta.live_pid(marker) == proc.pid
        adopted = tta.Adopted(proc.pid)
        assert adopted.poll() is None
    finally:
        proc.kill()
        proc.wait()
    assert tta.live_pid(marker) is None and adopted.poll() == 0  # a stale marker: the run is pending again


def test_the_multi_seed_report(tmp_path):
    """Hand-made runs of two seeds: the report's means, intervals, goal column, per-seed rows and plot."""
    common = {"per_device_train_batch_size": 16, "num_generations": 4, "max_completion_length": 24,
              "temperature": 0.7, "learning_rate": 3e-5, "lr_scheduler_type": "constant", "beta": 0.0}

    def run(seed, method, curve, steps):
        row = {"seed": seed, "method": method, "label": tta.METHODS[method].label, "curve": curve,
               "train_seconds": curve[-1][0], "steps": steps, "gen_per_trained_token": 1.0, "task": "hand-made",
               "before": {"acc": curve[0][1]}, "protocol": {"clock": "cpu", "grpo_steps": 20}, "common": common,
               "evaluations": [{"acc": a, "se": 0.02} for _, a in curve[1:]]}
        os.makedirs(tmp_path / f"seed{seed}", exist_ok=True)
        (tmp_path / f"seed{seed}" / f"{method}.json").write_text(json.dumps(row))

    run(0, "grpo", REF["curve"], 20)
    run(0, "dapo", [[0.0, 0.1], [25.0, 0.42], [50.0, 0.5], [99.0, 0.45]], 12)  # 0.25x, +0.05
    run(1, "grpo", [[0.0, 0.2], [60.0, 0.5], [120.0, 0.5]], 20)
    run(1, "dapo", [[0.0, 0.2], [30.0, 0.3], [60.0, 0.45], [118.0, 0.48]], 12)  # not reached, -0.02
    result = tta.report(str(tmp_path))
    s = result["summary"]["dapo"]
    assert (s["seeds"], s["reached_by_half"], s["not_reached"]) == (2, 1, 1)
    assert s["diff_at_budget"] == pytest.approx(0.015) and s["diff_at_budget_ci"] == pytest.approx((-0.02, 0.05))
    assert s["time_ratio_mean"] == pytest.approx((0.25 + 118 / 120) / 2)
    assert result["summary"]["grpo"]["acc_at_budget"] == pytest.approx(0.45)
    md = (tmp_path / "time_to_accuracy.md").read_text()
    dapo_row = next(line for line in md.splitlines() if line.startswith("| DAPO "))
    assert "1/2" in dapo_row and ">= 0.62x" in dapo_row and "undecided (2 of 5 seeds)" in dapo_row
    assert "| 1    | 0.200  | DAPO" in md and "not reached" in md
    assert "- seed 0, DAPO: 0.00=0.100 0.25=0.420 0.50=0.500 0.99=0.450" in md
    # each evaluation's SE 0.02, no per-question scores: sqrt(2 x 0.02^2) / 2 for the mean, no paired SE
    assert s["noise_se_acc"] == pytest.approx(0.02 / math.sqrt(2)) and math.isnan(s["noise_se_diff"])
    assert "| DAPO            | 0.020-0.020" in md
    saved = json.loads((tmp_path / "time_to_accuracy.json").read_text())
    assert saved["runs"]["1"]["dapo"]["steps"] == 12 and saved["per_seed"]["dapo"]["0"]["time_ratio"] == 0.25
    import importlib.util

    assert (tmp_path / "time_to_accuracy.png").exists() or importlib.util.find_spec("matplotlib") is None


def test_the_step_by_step_table():
    run = {"clock": "cpu", "evaluations": [{"step": 2, "acc": 0.5}], "steps_log": [
        {"step": 1, "clock_cpu": 25.0, "clock_wall": 60.0, "rewards/word_problem_reward/mean": 0.25,
         "entropy": 0.8, "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "frac_reward_zero_std": 0.75,
         "dapo/groups_kept": 4.0, "dapo/groups_generated": 11.0, "effective_sequences": 16, "trained_sequences": 16,
         "completions/mean_length": 20.5, "completions/clipped_ratio": 0.5, "dapo/overlong_penalty": -0.4,
         "dapo/frac_overlong_penalized": 0.6, "gen_tokens": 900, "trained_tokens": 300, "async/staleness": 0.5},
        {"step": 2, "clock_cpu": 50.0, "clock_wall": 70.0, "reward": 0.5, "gen_tokens": 0, "trained_tokens": 0,
         "effective_sequences": 4, "trained_sequences": 16}]}
    lines = tta.steps_table(run, 100.0).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    header = cells[0]
    first, second = dict(zip(header, cells[2])), dict(zip(header, cells[3]))
    assert first["clock"] == "0.25" and first["task reward"] == "0.25" and first["groups with spread"] == "0.25"
    assert first["kept / generated"] == "4/11" and first["eff. seqs"] == "16" and first["gen/trained tok"] == "3"
    assert first["overlong pen."] == "-0.4" and first["held-out"] == ""
    assert second["task reward"] == "0.5" and second["entropy"] == "" and second["held-out"] == "0.500"
    assert second["eff. seqs"] == "4" and second["gen/trained tok"] == ""
    assert first["staleness"] == "0.5" and second["staleness"] == ""  # a synchronous step logs none


def test_the_diagnosis_of_a_run():
    """Peak, fall and the per-step signs read off a hand-built run: a peak of 0.6 at step 2 that falls to 0.4, the
    entropy at each, 16/4/0 effective sequences (one step without gradient), the overlong share of steps 1-3."""
    run = {"evaluations": [{"step": 1, "acc": 0.3}, {"step": 2, "acc": 0.6}, {"step": 4, "acc": 0.4}], "steps_log": [
        {"step": 1, "entropy": 0.8, "effective_sequences": 16, "clip_ratio/low_mean": 0.0,
         "clip_ratio/high_mean": 0.01, "dapo/frac_overlong_penalized": 0.9, "completions/mean_length": 23.0},
        {"step": 2, "entropy": 0.5, "effective_sequences": 4, "dapo/frac_overlong_penalized": 0.3},
        {"step": 3, "entropy": 0.3, "effective_sequences": 0, "dapo/frac_overlong_penalized": 0.0},
        {"step": 4, "entropy": 0.1, "effective_sequences": 4, "completions/mean_length": 14.0}]}
    d = tta.run_diagnosis(run)
    assert (d["peak"], d["peak_step"], d["final"]) == (0.6, 2, 0.4) and d["drop"] == pytest.approx(0.2)
    assert (d["entropy_first"], d["entropy_at_peak"], d["entropy_last"]) == (0.8, 0.5, 0.1)
    assert d["effective_mean"] == 6.0 and d["steps_without_gradient"] == 1 and d["clip_max"] == 0.01
    assert d["overlong_share_first3"] == pytest.approx(0.4) and (d["length_first"], d["length_last"]) == (23.0, 14.0)
    table = tta.diagnosis_table({0: {"dapo": run}}, [0], ["dapo"], {"dapo": "DAPO"})
    row = [c.strip() for c in table.splitlines()[2].strip("|").split("|")]
    assert row == ["0", "DAPO", "0.600 (step 2)", "0.400", "0.200", "0.80 / 0.50 / 0.10", "6.0", "1", "0.01", "0.40",
                   "23.0 -> 14.0"]
