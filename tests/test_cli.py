"""The `trl-ppo-variants` command line: TRL's parser (YAML + command line), data loading, rewards by name, and bad
input reported as one line (exit 2) before any model is loaded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ppo_variants import cli

ROOT = Path(__file__).resolve().parents[1]
REWARD = "trl_ppo_variants.toy:addition_reward"


@pytest.fixture
def toy_jsonl(tmp_path, toy_dataset):
    path = tmp_path / "toy.jsonl"
    toy_dataset.select(range(32)).to_json(str(path))
    return str(path)


@pytest.fixture
def no_model_load(monkeypatch):
    """Fails the test if the CLI gets as far as building a trainer (i.e. loading the model)."""
    def forbidden(*args, **kwargs):
        raise AssertionError("the model was about to be loaded")

    monkeypatch.setattr(cli, "build_trainer", forbidden)


def _base(model_dir, data, tmp_path):
    return ["--model_name_or_path", model_dir, "--dataset_name", data, "--reward_funcs", REWARD,
            "--output_dir", str(tmp_path / "out"), "--use_cpu", "true", "--bf16", "false",
            "--per_device_train_batch_size", "8", "--num_generations", "4", "--max_completion_length", "4",
            "--max_steps", "1", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]


def _one_line_error(capsys, code, *needles):
    err = capsys.readouterr().err.strip()
    assert code == 2, err
    # progress bars of `datasets` (loading a file) may precede it; the error itself is exactly one line, the last
    lines = [line for line in err.splitlines() if "examples/s]" not in line]
    assert len(lines) == 1, err
    assert lines[0].startswith("trl-ppo-variants: error: "), err
    assert "Traceback" not in err
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


# ------------------------------------------------------------------------------------------------ help
def test_top_level_help_lists_every_algorithm():
    proc = subprocess.run([sys.executable, "-m", "trl_ppo_variants", "--help"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    for name in cli.ALGORITHMS:
        assert f"\n  {name} " in proc.stdout
    assert "--config" in proc.stdout and "accelerate launch" in proc.stdout


def test_console_script_is_installed():
    exe = ROOT / ".venv" / "bin" / "trl-ppo-variants"
    if not exe.exists():
        pytest.skip("the package is not installed in .venv (pip install -e .)")
    proc = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "reinforce_pp_baseline" in proc.stdout


def test_no_arguments_prints_help_and_fails(capsys):
    assert cli.main([]) == 2
    assert "algorithms:" in capsys.readouterr().out


def test_algorithm_help_lists_its_fields(capsys):
    assert cli.main(["rloo", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--normalize_advantages", "--reward_clip_range", "--kl_in_reward_coef",  # RLOOConfig / ours
                 "--num_generations", "--max_completion_length",  # GRPOConfig
                 "--model_name_or_path", "--use_peft", "--lora_r",  # ModelConfig
                 "--reward_funcs", "--dataset_map", "--prompt_column", "--config"):  # script arguments
        assert flag in out, flag


def test_missing_trainer_module_is_reported_not_crashing(monkeypatch, capsys):
    monkeypatch.setitem(cli.ALGORITHMS, "future", cli.Algorithm("does_not_exist", "XConfig", "XTrainer", "future"))
    assert not cli.algorithm_available("future")
    assert "[not installed: trl_ppo_variants.trainers.does_not_exist]" in cli.top_level_help()
    _one_line_error(capsys, cli.main(["future", "--config", "x.yaml"]), "'future'", "not available",
                    "trl_ppo_variants.trainers.does_not_exist")


# ------------------------------------------------------------------------------------------------ parsing
def test_yaml_then_command_line_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1.0e-6\nnum_generations: 4\nbeta: 0.1\nmax_completion_length: 33\n"
                      "reward_funcs: [math_accuracy]\nenv:\n  TRL_PPO_VARIANTS_TEST_ENV: '7'\n")
    script, train, model, _ = cli.parse_args("rloo", ["--config", str(recipe), "--learning_rate", "2e-6",
                                                      "--output_dir", str(tmp_path), "--use_cpu", "true",
                                                      "--bf16", "false"])
    assert train.learning_rate == 2e-6  # the command line wins
    assert train.max_completion_length == 33 and train.beta == 0.1  # the recipe's values
    assert train.kl_in_reward_coef == 0.1  # RLOOConfig's __post_init__ ran on the parsed values
    assert script.reward_funcs == ["math_accuracy"]
    assert os.environ.pop("TRL_PPO_VARIANTS_TEST_ENV") == "7"  # TrlParser's `env:` section


def test_reinforce_pp_baseline_name_presets_baseline(tmp_path):
    pytest.importorskip("trl_ppo_variants.trainers.reinforce_pp", reason="REINFORCE++ trainer not installed")
    common = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"]
    _, train, _, _ = cli.parse_args("reinforce_pp_baseline", common)
    assert train.baseline is True and train.kl_loss_estimator == "k2"
    _, train, _, _ = cli.parse_args("reinforce_pp", common)
    assert train.baseline is False
    with pytest.raises(cli.CLIError, match="baseline: expected True for algorithm 'reinforce_pp_baseline'"):
        cli.parse_args("reinforce_pp_baseline", common + ["--baseline", "false"])


# ------------------------------------------------------------------------------------------------ bad input
def test_unknown_algorithm(capsys):
    _one_line_error(capsys, cli.main(["rlo", "--config", "x.yaml"]), "unknown algorithm 'rlo'", "did you mean 'rloo'",
                    "remax, rloo, reinforce_pp")


def test_unknown_field_in_recipe(tmp_path, capsys, no_model_load):
    recipe = tmp_path / "bad.yaml"
    recipe.write_text("learnig_rate: 1.0e-6\n")
    _one_line_error(capsys, cli.main(["rloo", "--config", str(recipe)]), "unknown field 'learnig_rate'",
                    "did you mean 'learning_rate'", str(recipe))


def test_unknown_field_on_command_line(capsys, no_model_load):
    _one_line_error(capsys, cli.main(["rloo", "--num_generation", "4", "--use_cpu", "true", "--bf16", "false"]),
                    "--num_generation", "did you mean '--num_generations'")


def test_field_of_another_algorithm_is_unknown(tmp_path, capsys, no_model_load):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("dynamic_sampling: true\n")  # a DAPO field given to RLOO
    _one_line_error(capsys, cli.main(["rloo", "--config", str(recipe)]), "unknown field 'dynamic_sampling' for rloo")


def test_bad_value_type_and_bad_value(capsys, no_model_load):
    _one_line_error(capsys, cli.main(["rloo", "--learning_rate", "fast"]), "--learning_rate", "'fast'")
    _one_line_error(capsys, cli.main(["rloo", "--epsilon", "-1", "--use_cpu", "true", "--bf16", "false"]),
                    "epsilon: expected a number >= 0")


def test_missing_recipe_file(capsys):
    _one_line_error(capsys, cli.main(["rloo", "--config", "/nonexistent/recipe.yaml"]), "no such recipe file")


def test_unknown_reward_function(tmp_path, toy_model_dir, toy_jsonl, capsys, no_model_load):
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    args[args.index(REWARD)] = "math_acuracy"
    _one_line_error(capsys, cli.main(["rloo", *args]), "unknown reward function 'math_acuracy'",
                    "did you mean 'math_accuracy'")
    args[args.index("math_acuracy")] = "no_such_module_xyz:reward"
    _one_line_error(capsys, cli.main(["rloo", *args]), "cannot import module 'no_such_module_xyz'")
    args[args.index("no_such_module_xyz:reward")] = "trl_ppo_variants.toy:no_such_reward"
    _one_line_error(capsys, cli.main(["rloo", *args]), "has no function 'no_such_reward'")


def test_model_path_that_does_not_exist(tmp_path, toy_jsonl, capsys, no_model_load):
    _one_line_error(capsys, cli.main(["rloo", *_base(str(tmp_path / "no_model"), toy_jsonl, tmp_path)]),
                    "model_name_or_path", "no such directory", "no_model")
    (tmp_path / "empty").mkdir()
    _one_line_error(capsys, cli.main(["rloo", *_base(str(tmp_path / "empty"), toy_jsonl, tmp_path)]),
                    "model_name_or_path", "has no config.json")


def test_hub_model_not_cached_offline(tmp_path, toy_jsonl, capsys, no_model_load, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    _one_line_error(capsys, cli.main(["rloo", *_base("nobody-xyz/not-a-model", toy_jsonl, tmp_path)]),
                    "'nobody-xyz/not-a-model'", "not in the Hub cache")


def test_missing_prompt_column(tmp_path, toy_model_dir, toy_jsonl, capsys, no_model_load):
    args = _base(toy_model_dir, toy_jsonl, tmp_path) + ["--prompt_column", "question"]
    _one_line_error(capsys, cli.main(["rloo", *args]), "prompt_column", "no column 'question'", "prompt, answer")


def test_dataset_without_the_column_a_reward_needs(tmp_path, toy_model_dir, capsys, no_model_load):
    data = tmp_path / "no_answer.jsonl"
    data.write_text("\n".join(json.dumps({"prompt": f"{i}+1="}) for i in range(8)))
    _one_line_error(capsys, cli.main(["rloo", *_base(toy_model_dir, str(data), tmp_path)]),
                    "'trl_ppo_variants.toy:addition_reward' needs the dataset column 'answer'")
    args = _base(toy_model_dir, str(data), tmp_path)
    args[args.index(REWARD)] = "math_accuracy"  # a built-in reading its truth from **kwargs
    _one_line_error(capsys, cli.main(["rloo", *args]), "'math_accuracy' needs the dataset column 'answer'")


def test_missing_dataset_file_and_no_reward(tmp_path, toy_model_dir, toy_jsonl, capsys, no_model_load):
    _one_line_error(capsys, cli.main(["rloo", *_base(toy_model_dir, str(tmp_path / "nope.jsonl"), tmp_path)]),
                    "dataset_name", "no such file")
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    i = args.index("--reward_funcs")
    del args[i:i + 2]
    _one_line_error(capsys, cli.main(["rloo", *args]), "reward_funcs: expected at least one reward function")


def test_trl_errors_at_setup_are_one_line(tmp_path, toy_model_dir, toy_jsonl, capsys):
    """An error raised inside TRL while building the trainer (here a batch that does not split into groups of G)
    is caught at the CLI boundary: one line, exit 2."""
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    args[args.index("--per_device_train_batch_size") + 1] = "3"
    line = _one_line_error(capsys, cli.main(["rloo", *args]))
    assert "num_generations" in line or "divisible" in line, line


# ------------------------------------------------------------------------------------------------ data and rewards
def test_required_columns_from_signatures():
    def needs_solution(completions, solution, **kwargs):
        return [0.0] * len(completions)

    def needs_nothing(prompts, completions, completion_ids, trainer_state=None, **kwargs):
        return [0.0] * len(completions)

    assert cli.required_columns(needs_solution) == ["solution"]
    assert cli.required_columns(needs_nothing) == []
    assert cli.required_columns(cli.resolve_reward(REWARD)) == ["answer"]
    assert cli.required_columns(cli.resolve_reward("format")) == []
    assert cli.required_columns(cli.resolve_reward("math_accuracy")) == ["answer"]


def test_overlong_builtin_takes_lengths_from_the_run(tmp_path):
    _, train, _, _ = cli.parse_args("rloo", ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false",
                                             "--max_completion_length", "100"])
    reward = cli.resolve_reward("overlong", train)
    assert reward.max_completion_len == 100 and reward.soft_punish_cache == 20  # DAPO's 20% cache
    assert reward(completion_ids=[[0] * 80, [0] * 90, [0] * 101]) == [0.0, -0.5, -1.0]


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet", "csv"])
def test_local_dataset_formats(tmp_path, toy_dataset, fmt):
    path = tmp_path / f"data.{fmt}"
    small = toy_dataset.select(range(10))
    {"jsonl": small.to_json, "json": small.to_json, "parquet": small.to_parquet, "csv": small.to_csv}[fmt](str(path))
    script, train_args, _, dataset_args = cli.parse_args(
        "rloo", ["--dataset_name", str(path), "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"])
    train, evaluation = cli.load_train_dataset(script, dataset_args, train_args)
    assert len(train) == 10 and evaluation is None
    assert [str(x) for x in train["answer"]] == [str(x) for x in small["answer"]]


def test_gsm8k_map_and_system_prompt(tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    rows = [{"question": "Tom has 3 apples and buys 1,231 more. How many?",
             "answer": "3 + 1231 = <<3+1231=1234>>1234\n#### 1,234"},
            {"question": "What is 2 - 5?", "answer": "2 - 5 = -3\n#### -3"}]
    data.write_text("\n".join(json.dumps(r) for r in rows))
    script, train_args, _, dataset_args = cli.parse_args(
        "rloo", ["--dataset_name", str(data), "--dataset_map", "gsm8k", "--system_prompt", "Be brief.",
                 "--max_train_samples", "1", "--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"])
    train, _ = cli.load_train_dataset(script, dataset_args, train_args)
    assert len(train) == 1
    assert train[0]["answer"] == "1234"
    assert train[0]["prompt"] == [{"role": "system", "content": "Be brief."},
                                  {"role": "user", "content": rows[0]["question"]}]
    assert cli.gsm8k(rows[1])["answer"] == "-3"
    math_accuracy = cli.resolve_reward("math_accuracy")
    assert math_accuracy(["so \\boxed{1234}", "1,234", "1233"], answer=["1234"] * 3) == [1.0, 1.0, 0.0]


def test_step_reward_funcs_only_where_the_config_takes_them(tmp_path, toy_model_dir, toy_jsonl, capsys,
                                                            no_model_load):
    steps = ["--step_reward_funcs", "trl_ppo_variants.toy:digit_step_rewards"]
    _one_line_error(capsys, cli.main(["rloo", *_base(toy_model_dir, toy_jsonl, tmp_path), *steps]),
                    "step_reward_funcs: expected none for rloo (step rewards are taken by reinforce_pp, ppo, vapo, "
                    "process_grpo)")
    _one_line_error(capsys, cli.main(["process_grpo", *_base(toy_model_dir, toy_jsonl, tmp_path),
                                      "--step_reward_funcs", "no_such_step_reward"]),
                    "unknown reward function 'no_such_step_reward'")
    data = tmp_path / "no_answer.jsonl"  # a step function needing an absent column is named under its own field
    data.write_text('{"prompt": "1+2="}\n' * 8)
    args = _base(toy_model_dir, str(data), tmp_path)
    del args[args.index("--reward_funcs") : args.index("--reward_funcs") + 2]
    _one_line_error(capsys, cli.main(["process_grpo", *args, *steps]),
                    "step_reward_funcs: 'trl_ppo_variants.toy:digit_step_rewards' needs the dataset column 'answer'")


def test_process_grpo_trains_from_step_rewards_alone(tmp_path, toy_model_dir, toy_jsonl, capsys):
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    del args[args.index("--reward_funcs") : args.index("--reward_funcs") + 2]  # no outcome reward at all
    code = cli.main(["process_grpo", *args, "--step_reward_funcs", "trl_ppo_variants.toy:digit_step_rewards",
                     "--step_separator", "1", "--logging_steps", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "trained process_grpo for 1 steps" in captured.out
    card = (tmp_path / "out" / "README.md").read_text()
    assert "trained with **GRPO with process supervision**" in card and "arXiv:2402.03300" in card
    assert "`rewards/digit_step_rewards/mean`" in card


# ------------------------------------------------------------------------------------------------ a real run
def test_cli_trains_saves_and_writes_the_card(tmp_path, toy_model_dir, toy_jsonl, capsys):
    """`python -m trl_ppo_variants rloo ...` in a fresh process: trains, saves the model and our model card."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    args[args.index("--max_steps") + 1] = "2"
    proc = subprocess.run([sys.executable, "-m", "trl_ppo_variants", "rloo", *args, "--logging_steps", "1"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trained rloo for 2 steps on 1 process(es)" in proc.stdout
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    card = (out / "README.md").read_text()
    assert "trained with **RLOO**" in card and "| `global_step` | 2 |" in card
