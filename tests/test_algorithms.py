"""The one table of algorithms (`trl_ppo_variants/algorithms.py`): every entry complete (classes that import and are
the package's exports, a paper, a recipe, demo settings that are fields of its config), and no other module listing
the algorithm names by hand."""

import ast
import dataclasses
import re
import sys
from pathlib import Path

import pytest

import trl_ppo_variants
from trl_ppo_variants import algorithms
from trl_ppo_variants.algorithms import ALGORITHMS, BASELINE, REGISTRY

ROOT = Path(__file__).resolve().parents[1]

#: the sources scanned for hand-written lists of algorithm names (the registry itself excepted)
SCANNED = ("trl_ppo_variants", "bench")
#: how many algorithm names make a literal a list of algorithms
LISTED = 3
#: literals that name several algorithms on purpose, by (file, the variable assigned): why
ALLOWED = {
    ("bench/bench_value.py", "ROWS"): "benchmark rows: GRPO, PPO, VAPO and VAPO's pre-training, each built by hand",
    ("bench/bench_value.py", "LABELS"): "the labels of those rows",
    ("bench/critic_learning.py", "VARIANTS"): "benchmark variants: an algorithm and its critic settings each",
    ("bench/time_to_accuracy.py", "DEFAULT_METHODS"): "benchmark variants (screening on and off) chosen to time",
}
#: tests hold per-algorithm data (settings, measured gains) by right; what they must not hold is a plain list of every
#: algorithm, which a new one would silently miss
TESTS_ALLOWED: dict = {}


def _names_in(node) -> list[str]:
    """The algorithm names written as string elements of a tuple/list/set display or as keys of a dict display."""
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        elements = node.elts
    elif isinstance(node, ast.Dict):
        elements = [k for k in node.keys if k is not None]
    else:
        return []
    return [e.value for e in elements if isinstance(e, ast.Constant) and e.value in REGISTRY]


def _assigned(tree) -> dict:
    """id(display node) -> the name of the variable whose assigned value contains it."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            name = next((t.id if isinstance(t, ast.Name) else getattr(t, "attr", None) for t in targets), None)
            for inner in ast.walk(node.value):
                out[id(inner)] = name
    return out


def hand_written_lists(source: str, path: str, full_copies_only: bool = False) -> list[str]:
    """`path:line: name: [...]` for each literal of `source` that lists algorithm names by hand: three or more of
    them (`full_copies_only`: a plain sequence of nothing but algorithm names that names every algorithm)."""
    tree = ast.parse(source)
    assigned = _assigned(tree)
    found = []
    for node in ast.walk(tree):
        names = _names_in(node)
        if not names:
            continue
        if full_copies_only:
            listed = (not isinstance(node, ast.Dict) and len(names) == len(node.elts)
                      and set(ALGORITHMS) <= set(names))
        else:
            listed = len(set(names)) >= LISTED
        if listed:
            found.append(f"{path}:{node.lineno}: {assigned.get(id(node))}: {names}")
    return found


def _offenders(folders, allowed, **kwargs) -> list[str]:
    found = []
    for folder in folders:
        for file in sorted((ROOT / folder).rglob("*.py")):
            path = file.relative_to(ROOT).as_posix()
            if path == "trl_ppo_variants/algorithms.py":
                continue
            for line in hand_written_lists(file.read_text(), path, **kwargs):
                name = line.split(": ")[1]
                if (path, name) not in allowed:
                    found.append(line)
    return found


def test_no_module_lists_the_algorithms_by_hand():
    """Everything that lists algorithms derives from `algorithms.REGISTRY` (issue 34): a literal naming three or more
    algorithms anywhere in the package or the benchmarks is a copy that the next algorithm will miss."""
    assert _offenders(SCANNED, ALLOWED) == []
    assert _offenders(["tests"], TESTS_ALLOWED, full_copies_only=True) == []


def test_every_allowed_list_is_still_there():
    """An exception that no longer matches anything is removed, not kept as a licence for the next list."""
    for (path, name), kwargs in [*[(k, {}) for k in ALLOWED], *[(k, {"full_copies_only": True}) for k in TESTS_ALLOWED]]:
        found = hand_written_lists((ROOT / path).read_text(), path, **kwargs)
        assert any(line.split(": ")[1] == name for line in found), (path, name)


def test_the_scan_finds_a_planted_list():
    planted = 'X = 1\nDEFAULT = ["rloo", "ppo", "dapo"]\nSETTINGS = {"ttrl": {}, "vapo": {}, "remax": {}}\n'
    assert hand_written_lists(planted, "m.py") == ["m.py:2: DEFAULT: ['rloo', 'ppo', 'dapo']",
                                                   "m.py:3: SETTINGS: ['ttrl', 'vapo', 'remax']"]
    assert hand_written_lists('PICK = ("grpo", "dapo")\nROWS = ["rloo_ref", "ppo_ref", "dapo"]\n', "m.py") == []
    every = f"ALL = {list(REGISTRY)!r}\nSOME = {list(REGISTRY)[:4]!r}\nDATA = {dict.fromkeys(REGISTRY, 1)!r}\n"
    assert [line.split(": ")[1] for line in hand_written_lists(every, "t.py", full_copies_only=True)] == ["ALL"]


# ------------------------------------------------------------------------------------------------ complete entries
@pytest.mark.parametrize("name", list(REGISTRY))
def test_entry_classes_import_and_are_the_exports(name):
    from trl_ppo_variants.trainers.base import VariantConfig, VariantTrainer

    algorithm = REGISTRY[name]
    assert algorithm.name == name and algorithm.available()
    config_cls, trainer_cls = algorithm.classes()
    assert issubclass(config_cls, VariantConfig) and issubclass(trainer_cls, VariantTrainer)
    assert trainer_cls.config_class is config_cls
    assert getattr(trl_ppo_variants, algorithm.config) is config_cls
    assert getattr(trl_ppo_variants, algorithm.trainer) is trainer_cls
    assert algorithms.of_trainer(trainer_cls, type("Args", (), dict(algorithm.preset))()) is algorithm
    fields = {f.name for f in dataclasses.fields(config_cls)}
    for key, _ in algorithm.preset:
        assert key in fields, (name, key)
    # the demos pass their settings to the config: a key that is not a field would fail there (the toy demo drops
    # what its config lacks, so a typo would be silently ignored)
    for settings in (algorithm.demo, algorithm.toy_demo):
        assert set(settings) <= fields, (name, set(settings) - fields)


def test_exports_are_the_entries_classes_and_nothing_else():
    classes = {c for a in REGISTRY.values() for c in (a.config, a.trainer)}
    assert set(trl_ppo_variants.__all__) == classes | {"VariantConfig", "VariantTrainer"}


@pytest.mark.parametrize("name", list(REGISTRY))
def test_entry_has_a_paper_a_summary_and_a_recipe(name):
    algorithm = REGISTRY[name]
    paper = algorithm.paper
    assert re.fullmatch(r"\d{4}\.\d{4,5}", paper.arxiv_id) and paper.arxiv_id in paper.bibtex, name
    assert paper.bibtex.startswith("@") and paper.bibtex.count("{") == paper.bibtex.count("}"), name
    assert algorithm.summary and "\n" not in algorithm.summary and algorithm.label
    if not algorithm.baseline:  # the baseline runs any recipe
        assert (ROOT / "recipes" / f"{name}.yaml").is_file(), name


def test_one_baseline_first_then_the_algorithms():
    assert [a for a in REGISTRY.values() if a.baseline] == [BASELINE] and list(REGISTRY)[0] == BASELINE.name
    assert list(ALGORITHMS) == list(REGISTRY)[1:]
    assert algorithms.get("dapo") is REGISTRY["dapo"] and algorithms.get("nope") is None


def test_package_description_names_every_algorithm():
    description = re.search(r'^description = "(.*)"$', (ROOT / "pyproject.toml").read_text(), flags=re.M).group(1)
    missing = [a.label for a in ALGORITHMS.values() if a.label not in description]
    assert not missing, f"pyproject's description lacks {missing}: {description!r}"


def test_the_registry_imports_nothing_heavy():
    import subprocess

    code = "import sys, trl_ppo_variants.algorithms; print(sorted({'torch', 'trl', 'transformers'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr
