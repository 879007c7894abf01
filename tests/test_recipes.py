"""Every recipe and accelerate config is parsed and validated; each algorithm's recipe runs a few steps on CPU with
the model and data swapped for the local tiny ones through command-line overrides; slow: 2-process runs of the CLI
under `accelerate launch` with the DDP, ZeRO-2 and ZeRO-3 configs of recipes/accelerate/, and the offline recipe of
the real model (recipes/smollm2_offline.yaml) run as it is, alone, under DDP and under ZeRO-2."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import worker_cores
from launcher import accelerate_launch

from trl_ppo_variants import cli
from trl_ppo_variants.algorithms import ALGORITHMS

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
ACCELERATE = RECIPES / "accelerate"
RECIPE_ALGOS = list(ALGORITHMS)  # one recipe per algorithm (the baseline, `grpo`, runs any of them)
OFFLINE = RECIPES / "smollm2_offline.yaml"  # any algorithm, the real model on CPU, no Hub
VLM = RECIPES / "vlm_ppo.yaml"  # PPO on a vision-language model (issue 27)
CPU = ["--use_cpu", "true", "--bf16", "false"]


def _require(algo):
    if not ALGORITHMS[algo].available():
        pytest.skip(f"trainer module {ALGORITHMS[algo].module_path} is not installed yet")


def _recipe(algo) -> dict:
    return yaml.safe_load((RECIPES / f"{algo}.yaml").read_text())


def test_one_recipe_per_algorithm_and_nothing_else():
    assert sorted(p.stem for p in RECIPES.glob("*.yaml")) == sorted(RECIPE_ALGOS + [OFFLINE.stem, VLM.stem])


@pytest.mark.parametrize("algo", RECIPE_ALGOS)
def test_recipe_states_command_hardware_and_lengths(algo):
    text = (RECIPES / f"{algo}.yaml").read_text()
    header = text.split("\n\n")[0]
    assert f"trl-ppo-variants {algo} --config recipes/{algo}.yaml" in header
    assert f"-m trl_ppo_variants {algo} --config recipes/{algo}.yaml" in header  # the accelerate form
    assert "Hardware:" in header and "arXiv" in header
    recipe = _recipe(algo)
    assert isinstance(recipe.get("max_completion_length"), int)  # explicit: TRL's default truncates silently
    assert recipe["model_name_or_path"] == "Qwen/Qwen3-0.6B"
    assert recipe.get("reward_funcs")


def test_recipes_readme_table_matches_the_recipes():
    """recipes/README.md's samples per prompt and lengths are the recipes' own (remax.yaml and reinforce_pp.yaml moved
    to the papers' one sample per prompt and the table still said 2 and 4; the table is generated since, by
    docs/_tools/generate.py, whose output tests/test_readme.py keeps current)."""
    rows = re.findall(r"^\| `(\w+)\.yaml` \|[^|]*\|[^|]*\| ([^|]+) \| (\d+) \|$", (RECIPES / "README.md").read_text(),
                      flags=re.M)
    assert sorted(name for name, _, _ in rows) == sorted(RECIPE_ALGOS)
    for name, samples, length in rows:
        recipe = _recipe(name)
        generations = recipe.get("n_votes", recipe.get("num_generations"))
        assert int(re.match(r"\d+", samples.strip()).group()) == generations, (name, samples, generations)
        assert ("greedy" in samples) == (name == "remax"), (name, samples)
        if "n_train" in recipe:
            assert f"{recipe['n_train']} trained" in samples, (name, samples)
        assert int(length) == recipe["max_completion_length"], (name, length)


def test_pyproject_ships_every_package_and_the_recipes():
    """The package list is explicit (the recipes are mapped from `recipes/` into `trl_ppo_variants.recipes`): every
    package of the source tree must be in it, and every recipe and accelerate config matched by its package data."""
    import fnmatch
    import tomllib

    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    packages = set(setuptools["packages"])
    source = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "trl_ppo_variants").rglob("__init__.py")}
    assert source <= packages, sorted(source - packages)
    dirs, data = setuptools["package-dir"], setuptools["package-data"]
    for path in [*RECIPES.glob("*.yaml"), RECIPES / "README.md", *ACCELERATE.glob("*.yaml")]:
        package = next(p for p, d in dirs.items() if (ROOT / d) == path.parent)
        assert any(fnmatch.fnmatch(path.name, pattern) for pattern in data[package]), path


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_an_installed_wheel_finds_its_recipes_by_name(tmp_path):
    """Built and installed like `pip install` does (a wheel, into a folder of its own): from a folder that is not a
    clone, `--config dapo` and the README's `--config recipes/dapo.yaml` read the shipped recipe, and `recipes`
    lists it."""
    import shutil

    source = tmp_path / "source"  # a copy: setuptools writes build/ and *.egg-info/ next to the sources
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    for name in ("trl_ppo_variants", "recipes"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "wheel"), str(source)], capture_output=True, text=True, timeout=500,
                           env=env, cwd=tmp_path)
    assert build.returncode == 0, build.stderr[-2000:]
    wheel = next((tmp_path / "wheel").glob("*.whl"))
    target = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "-q", "--target",
                              str(target), str(wheel)], capture_output=True, text=True, timeout=300, env=env)
    assert install.returncode == 0, install.stderr[-2000:]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env["PYTHONPATH"] = str(target)

    def run(*args):
        return subprocess.run([sys.executable, "-m", "trl_ppo_variants", *args], capture_output=True, text=True,
                              timeout=300, env=env, cwd=elsewhere)

    listing = run("recipes")
    assert listing.returncode == 0 and str(target / "trl_ppo_variants" / "recipes" / "dapo.yaml") in listing.stdout
    assert str(target / "trl_ppo_variants" / "recipes" / "accelerate" / "zero3.yaml") in listing.stdout
    for config in ("dapo", "recipes/dapo.yaml"):  # read and checked: TRL's GRPO has no dynamic_sampling
        proc = run("grpo", "--config", config)
        assert proc.returncode == 2 and "unknown field 'dynamic_sampling' for grpo" in proc.stderr, proc.stderr


@pytest.mark.parametrize("algo", RECIPE_ALGOS)
def test_recipe_parses_into_the_algorithm_config(tmp_path, algo):
    _require(algo)
    config_cls, _ = cli.load_algorithm(algo)
    script, train, model, _ = cli.parse_args(cli.resolve(algo), ["--config", str(RECIPES / f"{algo}.yaml"),
                                                                 "--output_dir", str(tmp_path), *CPU])
    assert type(train) is config_cls
    recipe = _recipe(algo)
    for key, value in recipe.items():  # every recipe value reached the dataclass it belongs to, unchanged
        if key in ("bf16", "output_dir", "env", "report_to"):  # overridden for CPU / normalised by transformers
            continue
        holder = next(obj for obj in (script, train, model) if hasattr(obj, key))
        got = getattr(holder, key)
        got = got.value if hasattr(got, "value") and not isinstance(got, (int, float, str)) else got
        if isinstance(value, float) or isinstance(got, float):
            assert got == pytest.approx(float(value)), key
        else:
            assert got == value, (key, got, value)
    # a few of the numbers the papers fix
    if algo == "dapo":
        assert (train.num_generations, train.epsilon, train.epsilon_high, train.beta) == (16, 0.2, 0.28, 0.0)
        assert train.lr_scheduler_type.value == "constant_with_warmup" and train.learning_rate == 1e-6
        assert train.overlong_penalty and train.dynamic_sampling
    if algo == "vapo":
        assert (train.learning_rate, train.critic_learning_rate, train.value_pretrain_steps) == (1e-6, 2e-6, 50)
        assert (train.lam_critic, train.length_adaptive_alpha, train.positive_lm_coef) == (1.0, 0.05, 0.1)
    if algo == "ttrl":
        assert train.lr_scheduler_type.value == "cosine" and train.learning_rate == 5e-7
        assert train.n_votes == 2 * train.n_train and train.num_generations == train.n_votes
    if algo == "reinforce_pp_baseline":
        assert train.baseline and train.kl_loss_estimator == "k2"
    if algo in ("reinforce_pp", "remax"):  # REINFORCE++: one sample per prompt; ReMax: one sample plus the greedy one
        assert train.num_generations == 1
    if algo == "process_grpo":  # the PRM's own step convention and the paper's KL
        assert train.step_separator == "\n\n" and train.process_reward_model_style == "qwen2.5-math-prm"
        assert (train.beta, train.learning_rate, train.loss_type) == (0.04, 1e-6, "grpo")


def test_wrong_field_name_in_a_recipe_is_an_error(tmp_path):
    bad = tmp_path / "dapo_typo.yaml"
    bad.write_text((RECIPES / "rloo.yaml").read_text() + "\nnum_generatoins: 8\n")
    with pytest.raises(cli.CLIError, match="unknown field 'num_generatoins' for rloo .*did you mean 'num_generations'"):
        cli.parse_args(cli.resolve("rloo"), ["--config", str(bad), "--output_dir", str(tmp_path), *CPU])


# ------------------------------------------------------------------------------------------------ accelerate configs
ACCELERATE_FILES = ["single_gpu", "multi_gpu", "zero1", "zero2", "zero3", "zero3_offload", "fsdp2",
                    "multi_node_zero3"]


def test_accelerate_config_set_is_complete():
    assert sorted(p.stem for p in ACCELERATE.glob("*.yaml")) == sorted(ACCELERATE_FILES)


@pytest.mark.parametrize("name", ACCELERATE_FILES)
def test_accelerate_config_is_valid(name):
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    path = ACCELERATE / f"{name}.yaml"
    config = ClusterConfig.from_yaml_file(str(path))  # raises on unknown top-level keys
    raw = yaml.safe_load(path.read_text())
    launch_dests = {a.dest for a in launch_command_parser()._actions}
    for section in ("deepspeed_config", "fsdp_config"):
        for key in raw.get(section) or {}:  # accelerate copies these onto its launch arguments
            assert key in launch_dests, (name, section, key)
    ds = raw.get("deepspeed_config") or {}
    assert "train_batch_size" not in path.read_text().replace("no `train_batch_size`", "").split("#")[0]
    assert not any("batch" in k for k in ds)  # the trainer fills the batch sizes
    if name.startswith("zero"):
        assert config.distributed_type.value == "DEEPSPEED"
        assert ds["zero_stage"] == int(name[4])
    if name.startswith("zero3") or name == "multi_node_zero3":
        assert ds["zero3_save_16bit_model"] is True  # save_model / push_to_hub write a usable checkpoint
    if name == "zero3_offload":
        assert ds["offload_optimizer_device"] == "cpu" and ds["offload_param_device"] == "cpu"
    if name == "fsdp2":
        assert raw["fsdp_config"]["fsdp_version"] == 2
    if name == "multi_node_zero3":
        assert config.num_machines == 2 and config.main_process_ip and config.num_processes == 16
    if name == "single_gpu":
        assert config.num_processes == 1


def test_accelerate_comments_explain_rl_settings():
    zero1 = (ACCELERATE / "zero1.yaml").read_text()
    zero3 = (ACCELERATE / "zero3.yaml").read_text()
    assert "train_batch_size" in zero1 and "auto" in zero1
    assert "ds3_gather_for_generation" in zero3
    assert "vllm_enable_sleep_mode" in zero3 and "colocate" in zero3
    guide = (ROOT / "docs" / "how-to" / "distributed.md").read_text()  # the docs page that explains them
    assert "trl vllm-serve" in guide and "vllm_mode server" in guide.replace(":", "")
    assert "--main_process_ip" in guide and "--machine_rank" in guide


def test_wrong_key_in_accelerate_config_is_an_error(tmp_path):
    from accelerate.commands.config.config_args import ClusterConfig

    bad = tmp_path / "bad.yaml"
    bad.write_text((ACCELERATE / "zero2.yaml").read_text() + "num_proceses: 2\n")
    with pytest.raises(ValueError, match="num_proceses"):
        ClusterConfig.from_yaml_file(str(bad))


# ------------------------------------------------------------------------------------------------ recipes run on CPU
def tiny_overrides(algo, model_dir, data, out):
    """Command-line overrides that swap a real recipe's model and data for the local tiny ones, at toy scale."""
    args = ["--model_name_or_path", model_dir, "--dataset_name", data, "--dataset_config", "",
            "--dataset_map", "", "--system_prompt", "", "--prompt_column", "prompt", "--dataset_train_split", "train",
            "--dtype", "float32", "--output_dir", out, "--max_steps", "2", "--max_completion_length", "4",
            "--per_device_train_batch_size", "8", "--gradient_accumulation_steps", "1",
            "--steps_per_generation", "1", "--gradient_checkpointing", "false", "--save_strategy", "no",
            "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true", *CPU]
    if algo == "ttrl":  # label-free: keep the recipe's majority vote; the toy "answer" column is only logged
        args += ["--n_votes", "4", "--n_train", "2"]
    else:
        args += ["--reward_funcs", "trl_ppo_variants.toy:addition_reward", "--num_generations", "4"]
    if algo == "vapo":
        args += ["--value_pretrain_steps", "1"]
    if algo == "dapo":  # the recipe's shaping kept on: 4 tokens leave no default cache (20%, rounded down)
        args += ["--overlong_cache_length", "1"]
    if algo == "process_grpo":  # the recipe's 7B PRM swapped for a tiny random one, its steps for the toy's
        from trl_ppo_variants.toy import make_toy_prm

        prm = make_toy_prm(os.path.join(os.path.dirname(out), "toy_prm"))
        args += ["--process_reward_model_path", prm, "--process_reward_model_style", "trl",
                 "--trust_remote_code", "false", "--step_separator", "1"]
    return args


@pytest.mark.parametrize("algo", RECIPE_ALGOS)
@pytest.mark.timeout(300)
def test_recipe_runs_two_steps_on_cpu(tmp_path, toy_model_dir, toy_dataset, algo, capsys):
    _require(algo)
    data = tmp_path / "toy.jsonl"
    toy_dataset.select(range(64)).to_json(str(data))
    out = tmp_path / "out"
    code = cli.main([algo, "--config", str(RECIPES / f"{algo}.yaml"),
                     *tiny_overrides(algo, toy_model_dir, str(data), str(out))])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert f"trained {algo} for 2 steps" in captured.out
    card = (out / "README.md").read_text()
    from trl_ppo_variants.model_card import PAPERS

    assert f"trained with **{PAPERS[algo].name}**" in card
    assert "| `global_step` | 2 |" in card
    recipe = _recipe(algo)
    # the recipe's own algorithm settings survived the overrides (they are in the card's hyperparameter table)
    for key in ("epsilon_high", "beta", "learning_rate", "temperature", "critic_learning_rate", "lam_critic"):
        if key in recipe and recipe[key] is not None:
            row = re.search(rf"^\| `{key}` \| (.*) \|$", card, flags=re.M)
            assert row is not None and float(row.group(1)) == pytest.approx(float(recipe[key])), key
    assert (out / "model.safetensors").exists()
    if algo in ("ppo", "vapo"):  # save_value_model: true in the recipe -> the critic is exported next to the policy
        assert (out / "value_model").is_dir()
        assert "value_model/" in card


# ------------------------------------------------------------------------------------------------ the VLM recipe
def test_vlm_recipe_states_command_hardware_and_parses(tmp_path):
    header = VLM.read_text().split("\n\n")[0]
    assert "trl-ppo-variants ppo --config recipes/vlm_ppo.yaml" in header
    assert "-m trl_ppo_variants ppo --config recipes/vlm_ppo.yaml" in header
    assert "Hardware:" in header and "arXiv" in header
    script, train, model, _ = cli.parse_args(cli.resolve("ppo"),
                                             ["--config", str(VLM), "--output_dir", str(tmp_path), *CPU])
    assert "VL" in model.model_name_or_path and train.critic_backbone == "lora"
    assert isinstance(train.max_completion_length, int) and script.reward_funcs
    assert "`vlm_ppo.yaml`" in (RECIPES / "README.md").read_text()


@pytest.mark.timeout(300)
def test_vlm_recipe_runs_two_steps_on_cpu(tmp_path, capsys):
    """The CLI takes a VLM and an image dataset (a `save_to_disk` folder with an `image` column): the recipe, its model,
    data and reward swapped for the tiny Qwen2.5-VL and the colour task, trains 2 steps and exports the critic."""
    from trl_ppo_variants.toy_vlm import make_tiny_vlm, toy_vlm_dataset

    model_dir = make_tiny_vlm(str(tmp_path / "model"), "qwen2_5_vl")
    toy_vlm_dataset(16).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "out"
    code = cli.main(["ppo", "--config", str(VLM), "--model_name_or_path", model_dir,
                     "--dataset_name", str(tmp_path / "data"), "--prompt_column", "prompt", "--system_prompt", "",
                     "--reward_funcs", "trl_ppo_variants.toy_vlm:color_reward", "--dtype", "float32",
                     "--output_dir", str(out), "--max_steps", "2", "--max_completion_length", "4",
                     "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1",
                     "--gradient_checkpointing", "false", "--save_strategy", "no", "--logging_steps", "1",
                     "--report_to", "none", "--disable_tqdm", "true", *CPU])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-3000:]
    assert "trained ppo for 2 steps" in captured.out
    assert (out / "model.safetensors").exists() and (out / "value_model").is_dir()


# ------------------------------------------------------------------------------------------------ 2 processes
def _accelerate_launch(config, cli_args, machines):
    """`accelerate launch` of the CLI with a recipe's accelerate config on 2 CPU processes; returns stdout."""
    return accelerate_launch("trl_ppo_variants", *cli_args, module=True,
                             config_file=ACCELERATE / f"{config}.yaml", machines=machines).stdout


def _launch(config, algo, model_dir, data, out, machines, extra=()):
    return _accelerate_launch(config, [algo, "--config", str(RECIPES / f"{algo}.yaml"),
                                       *tiny_overrides(algo, model_dir, data, out),
                                       "--per_device_train_batch_size", "4", *extra], machines)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config,algo,expect", [
    # also as two machines in `make test`: the docs' command for CPU (tests/test_vapo.py's ZeRO-3 critic: DeepSpeed)
    pytest.param("multi_gpu", "rloo", "2 processes on cpu (DDP)", marks=pytest.mark.multinode),
    ("zero2", "dapo", "2 processes on cpu (DeepSpeed ZeRO-2)"),
    ("zero3", "reinforce_pp", "2 processes on cpu (DeepSpeed ZeRO-3)"),
])
def test_two_process_cli_under_accelerate_launch(tmp_path, toy_model_dir, toy_dataset, config, algo, expect,
                                                 machines):
    """The CLI runs unchanged under `accelerate launch` with the recipes' own accelerate configs (only the process
    count and mixed precision overridden for CPU): 2 gloo processes, DeepSpeed ZeRO-2/3 on CPU. On two machines the
    summary is still printed once (every machine's first process printed it) and the model saved once."""
    _require(algo)
    data = tmp_path / "toy.jsonl"
    toy_dataset.select(range(64)).to_json(str(data))
    out = tmp_path / "out"
    stdout = _launch(config, algo, toy_model_dir, str(data), str(out), machines)
    assert f"trained {algo} for 2 steps on {expect}" in stdout
    assert stdout.count(f"trained {algo} for 2 steps") == 1  # printed by the main process only
    card = (out / "README.md").read_text()
    assert "| `num_processes` | 2 |" in card
    assert (out / "model.safetensors").exists()


# ------------------------------------------------------------------------------------------------ the offline recipe
@pytest.mark.parametrize("algo", RECIPE_ALGOS)
def test_offline_recipe_parses_for_every_algorithm(tmp_path, algo):
    _require(algo)
    header = OFFLINE.read_text().split("\n\n")[0]
    assert "trl-ppo-variants rloo --config recipes/smollm2_offline.yaml" in header and "Hardware:" in header
    extra = ["--value_pretrain_steps", "2"] if algo == "vapo" else []  # as the recipe's header says
    script, train, model, _ = cli.parse_args(cli.resolve(algo),
                                             ["--config", str(OFFLINE), "--output_dir", str(tmp_path), *extra])
    assert model.model_name_or_path == "smollm2-135m-instruct" and script.dataset_name == "word_problems"
    assert script.reward_funcs == ["math_accuracy"] and train.use_cpu and not train.bf16
    assert (train.max_completion_length, train.per_device_train_batch_size) == (24, 16)


def _offline_cli(tmp_path, *extra):
    return ["--config", str(OFFLINE), "--output_dir", str(tmp_path / "out"), "--max_steps", "2", *extra]


def _offline_env(threads: int):
    # the checkpoint is already in the cache (fixture smollm2_dir): the run only reads it. A single process gets every
    # core of this test worker (the launched ones: one thread each, tests/launcher.py)
    return {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1",
            "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_offline_recipe_runs_as_is(tmp_path, smollm2_dir):
    """`trl-ppo-variants rloo --config recipes/smollm2_offline.yaml`, only the step count and output folder changed:
    the real model from the cache, the built-in task, the built-in reward; the trained model is saved."""
    exe = Path(sys.executable).with_name("trl-ppo-variants")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "trl_ppo_variants"]
    proc = subprocess.run([*cmd, "rloo", *_offline_cli(tmp_path)], env=_offline_env(worker_cores()), cwd=ROOT,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-5000:]
    assert "trained rloo for 2 steps on 1 process on cpu;" in proc.stdout
    out = tmp_path / "out"
    assert (out / "model.safetensors").exists() and (out / "tokenizer.json").exists()
    card = (out / "README.md").read_text()
    assert "trained with **RLOO**" in card and "| `max_completion_length` | 24 |" in card


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("config,algo,expect", [
    ("multi_gpu", "rloo", "2 processes on cpu (DDP)"),
    ("zero2", "dapo", "2 processes on cpu (DeepSpeed ZeRO-2)"),
])
def test_offline_recipe_under_accelerate_launch(tmp_path, smollm2_dir, config, algo, expect, machines):
    """The offline recipe on 2 CPU processes: DDP (gloo) and DeepSpeed ZeRO-2, with the recipes' accelerate configs
    (process count and mixed precision overridden for CPU) and a smaller batch per process."""
    stdout = _accelerate_launch(config, [algo, *_offline_cli(tmp_path, "--per_device_train_batch_size", "8",
                                                             "--max_completion_length", "12")], machines)
    assert f"trained {algo} for 2 steps on {expect}" in stdout
    assert stdout.count(f"trained {algo} for 2 steps") == 1
    card = (tmp_path / "out" / "README.md").read_text()
    assert "| `num_processes` | 2 |" in card
    assert (tmp_path / "out" / "model.safetensors").exists()
