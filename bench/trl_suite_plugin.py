"""pytest plugin loaded into a run of TRL's own `tests/test_grpo_trainer.py` by `trl_suite.py` (`-p trl_suite_plugin`).

Set by the environment:
    TRL_SUITE_TRAINER   which trainer replaces `GRPOTrainer`/`GRPOConfig` in the test module (a key of `TRAINERS`;
                        "grpo" is TRL's own, the baseline)
    TRL_SUITE_ASSETS    the folder built by `trl_suite_assets.build_assets` (the zen data sets; the tiny models are
                        found through `HF_HUB_CACHE=<assets>/hub`, set by the runner)
    TRL_SUITE_MAX_STEPS run length for the tests that leave `max_steps` at its default (empty or 0: TRL's own length)
    TRL_SUITE_REPORT    where to write the JSON report (one entry per test: outcome and a one-line cause)

Nothing of TRL's test file is changed: the module's `GRPOTrainer` and `GRPOConfig` names are rebound after import,
`datasets.load_dataset` reads the offline copies of `trl-internal-testing/zen*`, and names the test helpers import from
a newer or older `trl.import_utils` than the installed one are stubbed (reported in the JSON).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import re
from pathlib import Path

import pytest

from trl_ppo_variants.algorithms import ALGORITHMS, BASELINE

#: trainer key -> (module, trainer class, config class, fields set on the config's defaults): TRL's GRPO (the
#: baseline), ours (`our_grpo`), and every algorithm of the registry with the fields its name presets
TRAINERS = {
    "grpo": ("trl", "GRPOTrainer", "GRPOConfig", {}),
    "our_grpo": ("trl_ppo_variants", BASELINE.trainer, BASELINE.config, {}),
    **{name: ("trl_ppo_variants", a.trainer, a.config, dict(a.preset)) for name, a in ALGORITHMS.items()},
}

_TESTED_MODULE = "test_grpo_trainer"
_stubbed: list[str] = []
_results: dict[str, dict] = {}


def _stub_missing_import_utils() -> None:
    """`tests/testing_utils.py` of another TRL version may import availability checks the installed TRL lacks."""
    import trl.import_utils as utils

    for name in ("is_joblib_available",):
        if not hasattr(utils, name):
            module = name[len("is_"):-len("_available")]
            setattr(utils, name, lambda module=module: importlib.util.find_spec(module) is not None)
            _stubbed.append(f"trl.import_utils.{name}")


def _offline_load_dataset():
    """`datasets.load_dataset` with `trl-internal-testing/*` read from the assets folder (other paths unchanged)."""
    import datasets

    original = datasets.load_dataset
    root = Path(os.environ["TRL_SUITE_ASSETS"]) / "datasets"

    def load_dataset(path, name=None, *args, split=None, streaming=False, **kwargs):
        if not str(path).startswith("trl-internal-testing/"):
            return original(path, name, *args, split=split, streaming=streaming, **kwargs)
        data = datasets.load_from_disk(str(root / path / (name or "default")))
        if split is not None:
            data = data[split]
        if streaming:
            if isinstance(data, datasets.DatasetDict):
                return datasets.IterableDatasetDict({k: v.to_iterable_dataset() for k, v in data.items()})
            return data.to_iterable_dataset()
        return data

    datasets.load_dataset = load_dataset


def _run_length(config_cls):
    """A subclass of `config_cls` whose default run length is TRL_SUITE_MAX_STEPS (when set) and whose defaults get
    the trainer's fields (REINFORCE++-baseline: `baseline=True`)."""
    max_steps = int(os.environ.get("TRL_SUITE_MAX_STEPS") or 0)
    extra = TRAINERS[os.environ.get("TRL_SUITE_TRAINER", "grpo")][3]

    class SuiteConfig(config_cls):
        def __init__(self, *args, **kwargs):
            for key, value in extra.items():
                kwargs.setdefault(key, value)
            if max_steps > 0 and kwargs.get("max_steps", -1) == -1:
                kwargs["max_steps"] = max_steps
            super().__init__(*args, **kwargs)

    # the name users see is the config's; pickle (TrainingArguments are saved with torch.save) finds it here
    SuiteConfig.__name__ = config_cls.__name__
    SuiteConfig.__qualname__ = f"Suite{config_cls.__name__}"
    SuiteConfig.__module__ = __name__
    globals()[SuiteConfig.__qualname__] = SuiteConfig
    return SuiteConfig


def pytest_configure(config):
    _stub_missing_import_utils()
    # registers the image-only Qwen-VL processors of the offline VLM stand-ins with AutoProcessor
    importlib.import_module("trl_ppo_variants.toy_vlm")
    if os.environ.get("TRL_SUITE_ASSETS"):
        _offline_load_dataset()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(session, config, items):
    key = os.environ.get("TRL_SUITE_TRAINER", "grpo")
    module_name, trainer_name, config_name, _ = TRAINERS[key]
    module = importlib.import_module(module_name)
    trainer_cls, config_cls = getattr(module, trainer_name), getattr(module, config_name)
    rebound = set()
    for item in items:
        test_module = getattr(item, "module", None)
        if test_module is None or not test_module.__name__.endswith(_TESTED_MODULE) or test_module in rebound:
            continue
        test_module.GRPOTrainer = trainer_cls
        test_module.GRPOConfig = _run_length(config_cls)
        rebound.add(test_module)


_HUB_MISS = re.compile(r"couldn't connect to 'https://huggingface.co'|not a local folder and is not a valid model "
                       r"identifier|LocalEntryNotFoundError|offline mode is enabled", re.I)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A test that needs a Hub repository with no offline stand-in (the vision-language models, a real model) is
    reported as skipped with that reason, not as a failure of the trainer."""
    outcome = yield
    report = outcome.get_result()
    if call.excinfo is not None and report.failed and _HUB_MISS.search(str(call.excinfo.value)):
        report.outcome = "skipped"
        report.longrepr = (str(item.path), item.location[1] or 0,
                           "Skipped: no offline stand-in for a Hub repository it loads")


def one_line_cause(longrepr) -> str:
    """The exception of a failure as one line: `Type: first line of its message`."""
    crash = getattr(longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(longrepr)
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    if not lines:
        return "(no message)"
    line = lines[0]
    if len(lines) > 1 and re.fullmatch(r"[\w.]*(Error|Exception|Warning)", line.split(":")[0]) is None:
        line = " ".join(lines[:2])
    return line[:300]


def pytest_runtest_logreport(report):
    entry = _results.setdefault(report.nodeid, {"outcome": "passed"})
    if report.when == "call" and hasattr(report, "wasxfail"):
        entry["outcome"] = "xpassed" if report.passed else "xfailed"
        return
    if report.skipped and report.when in ("setup", "call"):
        entry["outcome"] = "skipped"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        entry["cause"] = reason.removeprefix("Skipped: ")[:300]
    elif report.failed:
        if entry["outcome"] != "failed":
            entry["outcome"] = "failed" if report.when == "call" else f"error ({report.when})"
            entry["cause"] = one_line_cause(report.longrepr)


def pytest_sessionfinish(session, exitstatus):
    path = os.environ.get("TRL_SUITE_REPORT")
    if path:
        Path(path).write_text(json.dumps({"trainer": os.environ.get("TRL_SUITE_TRAINER", "grpo"),
                                          "stubbed": _stubbed, "tests": _results}, indent=1))
