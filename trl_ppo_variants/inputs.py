"""What a `trl-ppo-variants` run reads and writes, checked before any model is loaded: the script arguments (dataset,
rewards, reward model), reward functions by name (this package's built-ins, TRL's, `module:function`), the dataset
(Hub, local files, built-in `word_problems`, a row map, the prompt column), the model (a Hub id, a local folder, the
built-in `smollm2-135m-instruct`), and the output folder, trackers and checkpoint to resume from.

Every function here reports bad input as a `CLIError`: one line naming the field and what was expected, which
`trl_ppo_variants.cli` prints (exit status 2).
"""

from __future__ import annotations

import difflib
import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field

from .rewards import required_columns


class CLIError(Exception):
    """Bad input: printed as one line on stderr, exit status 2."""


def one_line(error: BaseException) -> str:
    """An exception's message on one line (its type's name when it has none)."""
    text = " ".join(str(error).split())
    return text if text else type(error).__name__


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


# ------------------------------------------------------------------------------------------------- rewards
def _import_function(module_name: str, func_name: str, spec: str, field_name: str = "reward_funcs"):
    if os.getcwd() not in sys.path:  # `module:function` files next to the recipe, as `trl grpo` allows
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        raise CLIError(f"{field_name}: cannot import module '{module_name}' of '{spec}' "
                       f"(expected 'module:function' importable from the working directory): {one_line(e)}") from e
    except Exception as e:
        raise CLIError(f"{field_name}: importing module '{module_name}' of '{spec}' failed: {one_line(e)}") from e
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
#: takes its lengths from the run (`_overlong_lengths`), where `trl grpo` fixes them at 1280 / 256; the accuracy
#: rewards need `math-verify` and read the `solution` column.
TRL_REWARDS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward", "get_soft_overlong_punishment")
_NEEDS_MATH_VERIFY = ("accuracy_reward", "reasoning_accuracy_reward")


def _overlong_lengths(training_args, spec: str, field_name: str) -> dict:
    """The overlong penalty's lengths from the run, by DAPO's rule (Eq. 13, `overlong_cache_tokens`, which DAPO's
    config applies to its own shaping): `max_completion_length`, and the cache DAPO's config says
    (`overlong_cache_length`, else 20% of `max_completion_length`, rounded down). A cache of 0 tokens penalises
    nothing: an error, not a no-op."""
    from .trainers.dapo import overlong_cache_tokens

    max_len = int(training_args.max_completion_length)
    try:
        cache = overlong_cache_tokens(max_len, getattr(training_args, "overlong_cache_length", None),
                                      f"'{spec}' in {field_name}", hasattr(training_args, "overlong_cache_length"))
    except ValueError as e:
        raise CLIError(str(e)) from None
    return {"max_completion_len": max_len, "soft_punish_cache": int(cache)}


def _builtin_kwargs(name: str, training_args, field_name: str) -> dict:
    """Settings a built-in reward takes from the run: the overlong penalty's lengths."""
    if name != "overlong" or training_args is None:
        return {}
    return _overlong_lengths(training_args, name, field_name)


def _trl_reward(name: str, training_args, field_name: str):
    if name in _NEEDS_MATH_VERIFY and importlib.util.find_spec("math_verify") is None:
        raise CLIError(f"{field_name}: '{name}' (TRL's) needs the math-verify package (pip install math-verify)")
    from trl import rewards as trl_rewards

    if name == "get_soft_overlong_punishment":
        lengths = _overlong_lengths(training_args, name, field_name) if training_args is not None else \
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
            return get_reward_function(spec, **_builtin_kwargs(spec, training_args, field_name))
        except ValueError as e:
            raise CLIError(f"{field_name}: '{spec}': {one_line(e)}") from e
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


def is_model_alias(name: str | None) -> bool:
    """Whether `model_name_or_path` names a built-in model (`MODEL_ALIASES`) rather than a folder or a Hub id."""
    return _builtin(MODEL_ALIASES, name) is not None


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
        raise CLIError(f"{field_name}: '{name}' {one_line(e)}") from None


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
        raise CLIError(f"dataset_name: could not load '{name}': {one_line(e)}") from e

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
        raise CLIError(f"dataset_map: '{spec}' failed on '{name}': {type(e).__name__}: {one_line(e)}") from e


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


def dataset_hub_id(name: str | None) -> str | None:
    """The dataset name worth putting in a model card (Hub ids only; local paths mean nothing to a reader)."""
    if not name or os.path.exists(os.path.expanduser(name)) or _looks_local(name) or name in BUILTIN_DATASETS:
        return None
    return name


# ------------------------------------------------------------------------------------- what the run writes
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
        raise CLIError(one_line(e)) from e

