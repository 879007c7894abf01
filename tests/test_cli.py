"""The `trl-ppo-variants` command line: TRL's parser (YAML + command line), data loading, rewards by name, and bad
input reported as one line (exit 2) before any model is loaded."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from trl_ppo_variants import algorithms, cli, inputs

ROOT = Path(__file__).resolve().parents[1]
REWARD = "trl_ppo_variants.toy:addition_reward"


def parse(name: str, args: list[str]):
    """`cli.parse_args` of a command name, resolved as `main` resolves it."""
    return cli.parse_args(cli.resolve(name), args)


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
    for name in algorithms.REGISTRY:
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


@pytest.mark.parametrize("algorithm", list(algorithms.REGISTRY))
@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_every_algorithm_help_runs(algorithm, flag, capsys):
    """Every error message points to `<algorithm> --help`: it must run for every algorithm (a bare `%` in any field's
    help text went through argparse's %-formatting and crashed DAPO's)."""
    if not algorithms.REGISTRY[algorithm].available():
        pytest.skip(f"{algorithm} is not installed")
    assert cli.main([algorithm, flag]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"usage: trl-ppo-variants {algorithm}" in out and "--reward_funcs" in out and "--config" in out
    assert "%%" not in out


def test_dapo_help_in_a_fresh_process():
    """The exact command DAPO's errors tell the user to run."""
    proc = subprocess.run([sys.executable, "-m", "trl_ppo_variants", "dapo", "--help"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--overlong_cache_length" in proc.stdout and "20%" in proc.stdout and "%%" not in proc.stdout


def test_algorithm_help_lists_its_fields(capsys):
    assert cli.main(["rloo", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in ("--normalize_advantages", "--reward_clip_range", "--kl_in_reward_coef",  # RLOOConfig / ours
                 "--num_generations", "--max_completion_length",  # GRPOConfig
                 "--model_name_or_path", "--use_peft", "--lora_r",  # ModelConfig
                 "--reward_funcs", "--dataset_map", "--prompt_column", "--config"):  # script arguments
        assert flag in out, flag


def test_missing_trainer_module_is_reported_not_crashing(monkeypatch, capsys):
    future = algorithms.Algorithm("future", "Future", "does_not_exist", "XConfig", "XTrainer", "future",
                                  algorithms.REGISTRY["rloo"].paper)
    monkeypatch.setitem(algorithms.REGISTRY, "future", future)
    monkeypatch.setitem(algorithms.ALGORITHMS, "future", future)
    assert not future.available()
    assert "[not installed: trl_ppo_variants.trainers.does_not_exist]" in cli.top_level_help()
    _one_line_error(capsys, cli.main(["future", "--config", "x.yaml"]), "'future'", "not available",
                    "trl_ppo_variants.trainers.does_not_exist")


# ------------------------------------------------------------------------------------------------ parsing
def test_yaml_then_command_line_override(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1.0e-6\nnum_generations: 4\nbeta: 0.1\nmax_completion_length: 33\n"
                      "reward_funcs: [math_accuracy]\nenv:\n  TRL_PPO_VARIANTS_TEST_ENV: '7'\n")
    script, train, model, _ = parse("rloo", ["--config", str(recipe), "--learning_rate", "2e-6",
                                             "--output_dir", str(tmp_path), "--use_cpu", "true",
                                             "--bf16", "false"])
    assert train.learning_rate == 2e-6  # the command line wins
    assert train.max_completion_length == 33 and train.beta == 0.1  # the recipe's values
    assert train.kl_in_reward_coef == 0.1  # RLOOConfig's __post_init__ ran on the parsed values
    assert script.reward_funcs == ["math_accuracy"]
    assert os.environ.pop("TRL_PPO_VARIANTS_TEST_ENV") == "7"  # TrlParser's `env:` section


def test_config_with_an_equals_sign_reads_the_recipe(tmp_path, capsys, no_model_load):
    """`--config=PATH` is `--config PATH`: the same parsed run, and the recipe's keys are checked."""
    import dataclasses

    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1.0e-6\nnum_generations: 4\nbeta: 0.1\nmax_completion_length: 33\n"
                      "reward_funcs: [math_accuracy]\n")
    common = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"]
    spaced = parse("rloo", ["--config", str(recipe), *common])
    joined = parse("rloo", [f"--config={recipe}", *common])
    assert joined[1].max_completion_length == 33 and joined[0].reward_funcs == ["math_accuracy"]
    for a, b in zip(spaced, joined):
        assert dataclasses.asdict(a) == dataclasses.asdict(b)
    recipe.write_text("learnig_rate: 1.0e-6\n")
    _one_line_error(capsys, cli.main(["rloo", f"--config={recipe}", *common]), "unknown field 'learnig_rate'",
                    str(recipe))
    _one_line_error(capsys, cli.main(["rloo", "--config=", *common]), "--config: no such recipe file ''")


def test_reinforce_pp_baseline_name_presets_baseline(tmp_path):
    pytest.importorskip("trl_ppo_variants.trainers.reinforce_pp", reason="REINFORCE++ trainer not installed")
    common = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"]
    _, train, _, _ = parse("reinforce_pp_baseline", common)
    assert train.baseline is True and train.kl_loss_estimator == "k2"
    _, train, _, _ = parse("reinforce_pp", common)
    assert train.baseline is False
    with pytest.raises(cli.CLIError, match="baseline: expected True for algorithm 'reinforce_pp_baseline'"):
        parse("reinforce_pp_baseline", common + ["--baseline", "false"])


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


def test_dapo_refuses_the_overlong_reward_it_applies_itself(tmp_path, toy_model_dir, toy_jsonl, capsys):
    """`dapo --reward_funcs <task> overlong` would apply the overlong penalty twice: a one-line error."""
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    args.insert(args.index(REWARD) + 1, "overlong")
    args[args.index("--max_completion_length") + 1] = "10"
    _one_line_error(capsys, cli.main(["dapo", *args]),
                    "overlong_penalty: expected False when reward_funcs holds an overlong penalty")


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
    assert "trained process_grpo for 1 step on 1 process on cpu;" in captured.out
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
    assert "trained rloo for 2 steps on 1 process on cpu;" in proc.stdout
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    card = (out / "README.md").read_text()
    assert "trained with **RLOO**" in card and "| `global_step` | 2 |" in card


# ------------------------------------------------------------------------------------------------ a new user's hour
def _fresh_cli(args, cwd, extra_env=None, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    return subprocess.run([sys.executable, "-m", "trl_ppo_variants", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def test_one_line_errors_come_without_transformers_deprecation_warnings(tmp_path, toy_model_dir):
    """transformers' two-line `gradient_checkpointing is deprecated` FutureWarning (TRL's configs still use the old
    name, and TrainingArguments warns while the config is built) preceded every error found after parsing."""
    proc = _fresh_cli(["rloo", "--use_cpu", "true", "--bf16", "false", "--model_name_or_path", toy_model_dir,
                       "--reward_funcs", "math_acuracy"], tmp_path)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if "real_accelerator.py" not in line]  # DeepSpeed's CPU note
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("trl-ppo-variants: error: reward_funcs: unknown reward function 'math_acuracy'")


def test_no_model_at_all_is_named_first(capsys, no_model_load):
    """Without any argument, the first thing to fix is the model (on a machine without a GPU transformers would
    refuse TRL's default bf16 first)."""
    _one_line_error(capsys, cli.main(["rloo"]), "model_name_or_path: expected a Hub model id or a local model")


def test_bf16_refusal_on_a_machine_without_gpu_names_the_fields(toy_model_dir, capsys, no_model_load):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: bf16 is accepted")
    _one_line_error(capsys, cli.main(["rloo", "--model_name_or_path", toy_model_dir]),
                    "bf16: expected false on this machine", "use_cpu: true")


def test_unknown_command_line_field_comes_before_config_checks(capsys, no_model_load):
    """A typo is the error the user sees, not a config check that ran on the defaults (here: bf16 on a CPU)."""
    _one_line_error(capsys, cli.main(["rloo", "--learnig_rate", "1e-6"]), "unknown field '--learnig_rate'",
                    "did you mean '--learning_rate'")


def test_errors_that_came_after_the_model_loaded(tmp_path, toy_model_dir, toy_jsonl, capsys, no_model_load):
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    args[args.index("--output_dir") + 1] = str(a_file)
    _one_line_error(capsys, cli.main(["rloo", *args]), "output_dir:", "is a file")
    args[args.index(str(a_file))] = str(a_file / "sub")
    _one_line_error(capsys, cli.main(["rloo", *args]), "output_dir: cannot create", "is a file")
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    args[args.index("--report_to") + 1] = "wandbb"
    _one_line_error(capsys, cli.main(["rloo", *args]), "report_to: unknown tracker 'wandbb'", "did you mean 'wandb'")
    from transformers.integrations import get_available_reporting_integrations

    for tracker in ("wandb", "trackio", "tensorboard"):
        if tracker in get_available_reporting_integrations():
            continue
        args[args.index("--report_to") + 1] = tracker
        _one_line_error(capsys, cli.main(["rloo", *args]), f"report_to: '{tracker}' needs the", "pip install")


def test_resume_from_checkpoint_true_on_the_command_line(tmp_path, toy_model_dir, toy_jsonl, capsys):
    """`--resume_from_checkpoint true` is the YAML `true` (the last complete checkpoint of output_dir), not a path
    named 'true'; a missing checkpoint is one line before the model loads."""
    args = _base(toy_model_dir, toy_jsonl, tmp_path) + ["--logging_steps", "1"]
    _, train, _, _ = parse("rloo", [*args, "--resume_from_checkpoint", "true"])
    assert train.resume_from_checkpoint is True
    _, train, _, _ = parse("rloo", [*args, "--resume_from_checkpoint", "false"])
    assert train.resume_from_checkpoint is None
    built = []
    original = cli.build_trainer
    cli_build = lambda p: built.append(1) or original(p)  # noqa: E731
    import unittest.mock as mock

    with mock.patch.object(cli, "build_trainer", cli_build):
        _one_line_error(capsys, cli.main(["rloo", *args, "--resume_from_checkpoint", "true"]),
                        "resume_from_checkpoint: expected a complete checkpoint-N directory")
        _one_line_error(capsys, cli.main(["rloo", *args, "--resume_from_checkpoint", str(tmp_path / "nope")]),
                        "resume_from_checkpoint: no such checkpoint folder")
        assert not built  # both before the model loaded
        save = ["--save_strategy", "steps", "--save_steps", "1"]
        assert cli.main(["rloo", *args, *save]) == 0, capsys.readouterr().err[-2000:]  # a checkpoint at step 1
        capsys.readouterr()
        args[args.index("--max_steps") + 1] = "2"
        assert cli.main(["rloo", *args, *save, "--resume_from_checkpoint", "true"]) == 0, capsys.readouterr().err
    assert "trained rloo for 2 steps" in capsys.readouterr().out
    state = json.loads((tmp_path / "out" / "checkpoint-2" / "trainer_state.json").read_text())
    assert [e["step"] for e in state["log_history"] if "loss" in e] == [1, 2]  # step 1 from the resumed checkpoint


def test_reward_funcs_as_a_single_name_or_a_wrong_type(tmp_path, toy_model_dir, toy_jsonl, capsys, no_model_load):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"reward_funcs: {REWARD}\nstep_reward_funcs: 5\n")
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    del args[args.index("--reward_funcs") : args.index("--reward_funcs") + 2]
    script, *_ = parse("process_grpo", ["--config", str(recipe), *args])
    assert inputs.reward_names(script.reward_funcs, "reward_funcs") == [REWARD]  # one function, not its characters
    _one_line_error(capsys, cli.main(["process_grpo", "--config", str(recipe), *args]),
                    "step_reward_funcs: expected a reward function name or a list of names, got 5")
    recipe.write_text("reward_funcs: 5\n")
    _one_line_error(capsys, cli.main(["rloo", "--config", str(recipe), *args]),
                    "reward_funcs: expected a reward function name or a list of names, got 5")
    recipe.write_text("reward_funcs: math_accuracy\n")
    prepared = cli.prepare(cli.resolve("rloo"), ["--config", str(recipe), *args])  # every check short of the model
    assert [getattr(f, "__name__", None) for f in prepared["reward_funcs"]] == ["math_accuracy"]


def test_grpo_runs_trl_grpo_trainer_from_the_same_command_line(tmp_path, toy_model_dir, toy_jsonl, capsys,
                                                                monkeypatch):
    import trl

    built = []
    original = cli.build_trainer
    monkeypatch.setattr(cli, "build_trainer", lambda p: built.append(original(p)) or built[-1])
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    assert cli.main(["grpo", *args]) == 0, capsys.readouterr().err
    import importlib

    module = importlib.import_module(algorithms.BASELINE.module_path)  # the one place naming what `grpo` runs
    assert type(built[0]) is getattr(module, algorithms.BASELINE.trainer)
    assert type(built[0].args) is getattr(module, algorithms.BASELINE.config)
    assert isinstance(built[0], trl.GRPOTrainer) and isinstance(built[0].args, trl.GRPOConfig)
    assert not built[0].args.prompt_selection or built[0].args.prompt_selection == "none"  # TRL's GRPO by default
    assert "trained grpo for 1 step on 1 process on cpu" in capsys.readouterr().out
    assert (tmp_path / "out" / "README.md").exists() and (tmp_path / "out" / "model.safetensors").exists()
    _one_line_error(capsys, cli.main(["grpo", "--config", "dapo"]), "unknown field 'dynamic_sampling' for grpo",
                    "(a field of dapo)")
    _one_line_error(capsys, cli.main(["grpo", *args, "--kl_in_reward_coef", "0.1"]),
                    "kl_in_reward_coef: expected 0 (GRPO's KL is the loss term weighted by `beta`)")
    # one field turns prompt selection on, GRPO's estimator unchanged (issue 18)
    built.clear()
    assert cli.main(["grpo", *args, "--prompt_selection", "speed", "--output_dir", str(tmp_path / "speed")]) == 0
    assert built[0].args.prompt_selection == "speed" and built[0].prompt_selection is not None


def test_shipped_recipes_by_name(tmp_path, monkeypatch, capsys):
    """`--config dapo` (or `dapo.yaml`, or the README's `recipes/dapo.yaml` from a folder without it) is the recipe
    shipped with the package; a file of that name in the working folder wins."""
    monkeypatch.chdir(tmp_path)
    assert "dapo" in cli.recipe_names() and "smollm2_offline" in cli.recipe_names()
    common = ["--output_dir", str(tmp_path), "--use_cpu", "true", "--bf16", "false"]
    for name in ("dapo", "dapo.yaml", "recipes/dapo.yaml"):
        _, train, model, _ = parse("dapo", ["--config", name, *common])
        assert train.dynamic_sampling and train.num_generations == 16 and model.model_name_or_path == "Qwen/Qwen3-0.6B"
    (tmp_path / "dapo.yaml").write_text("num_generations: 8\nmax_completion_length: 10\n")
    _, train, _, _ = parse("dapo", ["--config", "dapo.yaml", *common])
    assert train.num_generations == 8
    with pytest.raises(cli.CLIError, match="no such recipe file 'dapoo'.*shipped recipe name.*dapo"):
        parse("dapo", ["--config", "dapoo", *common])
    assert cli.main(["recipes"]) == 0
    out = capsys.readouterr().out
    assert os.path.join(cli.recipes_dir(), "ttrl.yaml") in out
    assert os.path.join(cli.recipes_dir(), "accelerate", "zero2.yaml") in out


def test_run_summary_reads_as_words():
    from types import SimpleNamespace

    def trainer(n, kind, device="cpu", zero=None):
        plugin = SimpleNamespace(zero_stage=zero) if zero else None
        acc = SimpleNamespace(num_processes=n, distributed_type=SimpleNamespace(value=kind),
                              device=SimpleNamespace(type=device), state=SimpleNamespace(deepspeed_plugin=plugin))
        return SimpleNamespace(accelerator=acc, is_deepspeed_enabled=zero is not None)

    assert cli._describe_distribution(trainer(1, "NO")) == "1 process on cpu"
    assert cli._describe_distribution(trainer(2, "MULTI_CPU")) == "2 processes on cpu (DDP)"
    assert cli._describe_distribution(trainer(8, "MULTI_GPU", "cuda")) == "8 processes on cuda (DDP)"
    assert cli._describe_distribution(trainer(4, "DEEPSPEED", "cuda", 3)) == "4 processes on cuda (DeepSpeed ZeRO-3)"
    assert cli._describe_distribution(trainer(2, "FSDP", "cuda")) == "2 processes on cuda (FSDP)"


BROKEN_REWARDS = """
def raises(completions, **kwargs):
    raise ValueError("boom")


def wrong_count(completions, **kwargs):
    return [1.0]


def strings(completions, **kwargs):
    return ["a"] * len(completions)


def nothing(completions, **kwargs):
    return [None] * len(completions)


def half(completions, **kwargs):
    return [None if i % 2 else 1.0 for i in range(len(completions))]
"""


@pytest.mark.parametrize("func,expected", [("raises", "reward function 'raises' raised ValueError: boom"),
                                           ("wrong_count", "reward function 'wrong_count' returned 1 rewards for 8"),
                                           ("strings", "reward function 'strings' returned a non-number 'a'")])
def test_broken_reward_ends_with_our_error_as_the_last_line(tmp_path, toy_model_dir, toy_jsonl, func, expected):
    """TRL's "All reward functions returned None ... ensure that at least one reward function returns a valid
    reward" was printed before our error (untrue: the function failed), and a progress bar was the last line."""
    (tmp_path / "broken.py").write_text(BROKEN_REWARDS)
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    args[args.index(REWARD)] = f"broken:{func}"
    i = args.index("--disable_tqdm")
    del args[i : i + 2]  # the progress bar on screen, as a user has it
    proc = _fresh_cli(["rloo", *args], tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    screen = proc.stdout + proc.stderr
    assert "All reward functions returned None" not in screen
    last = proc.stderr.rstrip().splitlines()[-1].split("\r")[-1].strip()
    assert last.startswith("trl-ppo-variants: error: training rloo failed:") and expected in last, proc.stderr[-1500:]


def test_a_run_without_one_scorable_completion_fails(tmp_path, toy_model_dir, toy_jsonl):
    """All None: exit 1 with one line (it ran 2 steps and learned nothing); partly None: exit 0 and a summary line."""
    (tmp_path / "broken.py").write_text(BROKEN_REWARDS)
    args = _base(toy_model_dir, toy_jsonl, tmp_path)
    args[args.index("--max_steps") + 1] = "2"
    args[args.index(REWARD)] = "broken:nothing"
    proc = _fresh_cli(["rloo", *args], tmp_path)
    assert proc.returncode == 1, proc.stderr[-2000:]
    last = proc.stderr.rstrip().splitlines()[-1]
    assert last.startswith("trl-ppo-variants: error: training rloo failed: RuntimeError: no completion got a finite "
                           "reward in any of the run's 2 generation batches"), last
    assert "max_unscorable_batches" in last and "model and model card saved" not in proc.stdout
    args[args.index("broken:nothing")] = "broken:half"
    proc = _fresh_cli(["rloo", *args], tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert ("trl-ppo-variants: warning: 8 of 16 generated completions got no finite reward (every reward function "
            "returned None or NaN") in proc.stderr
