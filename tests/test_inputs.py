"""What a run reads, resolved and checked before any model loads (`trl_ppo_variants.inputs`): reward functions by
name (built-in, TRL's, `module:function`) and the dataset columns they need, local dataset formats, row maps and
system prompts. The errors as the command prints them: tests/test_cli.py."""

import json

import pytest
from test_cli import REWARD, parse

from trl_ppo_variants import inputs
from trl_ppo_variants.rewards import required_columns


def test_required_columns_from_signatures():
    def needs_solution(completions, solution, **kwargs):
        return [0.0] * len(completions)

    def needs_nothing(prompts, completions, completion_ids, trainer_state=None, **kwargs):
        return [0.0] * len(completions)

    assert required_columns(needs_solution) == ["solution"]
    assert required_columns(needs_nothing) == []
    assert required_columns(inputs.resolve_reward(REWARD)) == ["answer"]
    assert required_columns(inputs.resolve_reward("format")) == []
    assert required_columns(inputs.resolve_reward("math_accuracy")) == ["answer"]


def test_overlong_builtin_takes_lengths_from_the_run(tmp_path):
    _, train, _, _ = parse("rloo", ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false",
                                    "--max_completion_length", "100"])
    reward = inputs.resolve_reward("overlong", train)
    assert reward.max_completion_len == 100 and reward.soft_punish_cache == 20  # DAPO's 20% cache
    assert reward(completion_ids=[[0] * 80, [0] * 90, [0] * 101]) == [0.0, -0.5, -1.0]


CPU = ["--use_cpu", "true", "--bf16", "false"]


def test_overlong_rewards_take_dapos_cache_rule(tmp_path):
    """One rule for the overlong penalty's cache, DAPO's config (`effective_overlong_cache_length`): the built-in
    `overlong` and TRL's by name take it for every algorithm, DAPO's explicit `overlong_cache_length` included; where
    it is 0 tokens (below 5 tokens of `max_completion_length`, or set so) the penalty would be a no-op: an error."""
    from trl_ppo_variants.trainers.dapo import default_overlong_cache_length

    common = ["--output_dir", str(tmp_path), *CPU]
    for length in range(5, 13):
        _, train, _, _ = parse("rloo", [*common, "--max_completion_length", str(length)])
        _, dapo, _, _ = parse("dapo", [*common, "--max_completion_length", str(length)])
        for name in ("overlong", "get_soft_overlong_punishment"):
            assert inputs.resolve_reward(name, train).soft_punish_cache == dapo.effective_overlong_cache_length
        assert dapo.effective_overlong_cache_length == default_overlong_cache_length(length) == length // 5
    _, dapo, _, _ = parse("dapo", [*common, "--max_completion_length", "100", "--overlong_cache_length", "7"])
    assert inputs.resolve_reward("overlong", dapo).soft_punish_cache == 7
    _, short, _, _ = parse("rloo", [*common, "--max_completion_length", "4"])
    with pytest.raises(inputs.CLIError, match=r"^max_completion_length: expected an integer >= 5 with 'overlong' in "
                                              r"reward_funcs \(.*penalises nothing\), got 4$"):
        inputs.resolve_reward("overlong", short)
    _, dapo, _, _ = parse("dapo", [*common, "--max_completion_length", "100", "--overlong_cache_length", "0",
                                   "--overlong_penalty", "false"])
    with pytest.raises(inputs.CLIError, match=r"^overlong_cache_length: expected an integer >= 1 with "
                                              r"'get_soft_overlong_punishment' in reward_funcs \(.*penalises nothing"
                                              r": an error, not a no-op\), got 0$"):
        inputs.resolve_reward("get_soft_overlong_punishment", dapo)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_local_dataset_formats(tmp_path, toy_dataset, fmt):
    path = tmp_path / f"data.{fmt}"
    small = toy_dataset.select(range(10))
    {"jsonl": small.to_json, "json": small.to_json, "parquet": small.to_parquet, "csv": small.to_csv}[fmt](str(path))
    script, train_args, _, dataset_args = parse(
        "rloo", ["--dataset_name", str(path), "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"])
    train, evaluation = inputs.load_train_dataset(script, dataset_args, train_args)
    assert len(train) == 10 and evaluation is None
    assert [str(x) for x in train["answer"]] == [str(x) for x in small["answer"]]


def test_gsm8k_map_and_system_prompt(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "Tom has 3 apples and buys 1,231 more. How many?",
             "answer": "3 + 1231 = <<3+1231=1234>>1234\n#### 1,234"},
            {"question": "What is 2 - 5?", "answer": "2 - 5 = -3\n#### -3"}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    script, train_args, _, dataset_args = parse(
        "rloo", ["--dataset_name", str(data), "--dataset_map", "gsm8k", "--system_prompt", "Be brief.",
                 "--max_train_samples", "1", "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"])
    train, _ = inputs.load_train_dataset(script, dataset_args, train_args)
    assert len(train) == 1
    assert train[0]["answer"] == "1234"
    assert train[0]["prompt"] == [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": rows[0]["question"]}]
    assert inputs.gsm8k(rows[1])["answer"] == "-3"
    math_accuracy = inputs.resolve_reward("math_accuracy")
    assert math_accuracy(["so \\boxed{1234}", "1,234", "1233"], answer=["1234"] * 3) == [1.0, 1.0, 0.0]


def test_trl_reward_functions_by_their_short_names(tmp_path):
    """TRL's own rewards, by the names `trl grpo` accepts; the unknown-reward error lists them."""
    from trl import rewards as trl_rewards

    _, train, _, _ = parse("dapo", ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false",
                                    "--max_completion_length", "100", "--overlong_cache_length", "30"])
    assert inputs.resolve_reward("think_format_reward") is trl_rewards.think_format_reward
    assert inputs.resolve_reward("accuracy_reward") is trl_rewards.accuracy_reward
    assert inputs.resolve_reward("reasoning_accuracy_reward") is trl_rewards.reasoning_accuracy_reward
    assert required_columns(inputs.resolve_reward("accuracy_reward")) == ["solution"]
    overlong = inputs.resolve_reward("get_soft_overlong_punishment", train)  # the run's lengths, not 1280 / 256
    assert overlong(completion_ids=[[0] * 70, [0] * 85, [0] * 101]) == [0.0, -0.5, -1.0]
    with pytest.raises(inputs.CLIError) as err:
        inputs.resolve_reward("think_format_rewad")
    message = str(err.value)
    assert "did you mean 'think_format_reward'" in message
    for name in ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment",
                 "math_accuracy"):
        assert name in message
