"""The package's layers: the modules below `trl_ppo_variants/trainers/` (the math, the row moves, selection, guards,
generation, ...) never import from it, so that a trainer builds on them and not the other way round. Only the
modules whose job is to list or load the trainers may (an AST scan of every import statement, those inside functions
included, and of `importlib.import_module("...")` calls with a literal name)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "trl_ppo_variants"
TRAINERS = "trl_ppo_variants.trainers"
#: the modules that list or load the trainers: the package's exports, the registry, the CLI and its inputs, the demos
LOADERS = {"__init__.py", "__main__.py", "algorithms.py", "cli.py", "inputs.py", "demo.py", "toy_demo.py"}


def _absolute(module: str | None, level: int) -> str:
    """The absolute name of `from <level dots><module> import ...` in a module directly inside the package."""
    if level == 0:
        return module or ""
    return ".".join(["trl_ppo_variants"] + ([module] if module else []))  # deeper levels leave the package


def trainer_imports(source: str, name: str = "<module>") -> list[str]:
    """`name:line: statement` for every import of `trl_ppo_variants.trainers` (or a module in it) in `source`, the
    text of a module directly inside the package."""
    found = []
    for node in ast.walk(ast.parse(source, name)):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node.module, node.level)
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        elif (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)
              and isinstance(node.args[0].value, str)
              and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"):
            literal = node.args[0].value
            targets = [_absolute(literal.lstrip("."), len(literal) - len(literal.lstrip(".")))]
        else:
            continue
        if any(t == TRAINERS or t.startswith(TRAINERS + ".") for t in targets):
            found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_below_trainers_imports_from_it():
    below = sorted(p for p in PACKAGE.glob("*.py") if p.name not in LOADERS)
    assert len(below) > 10  # the scan sees the package
    found = [hit for path in below for hit in trainer_imports(path.read_text(), path.name)]
    assert not found, ("modules below trl_ppo_variants/trainers/ import from it (move what they need down, e.g. to "
                       "errors.py or the module itself):\n" + "\n".join(found))


@pytest.mark.parametrize("statement", [
    "from .trainers.base import VariantConfig",
    "from .trainers import base",
    "from . import trainers",
    "import trl_ppo_variants.trainers.dapo",
    "from trl_ppo_variants.trainers.rloo import RLOOTrainer as T",
    "def f():\n    from .trainers.ppo import PPOTrainer",
    "importlib.import_module('trl_ppo_variants.trainers.grpo')",
])
def test_the_scan_finds_a_planted_import(statement):
    assert trainer_imports(f"import torch\n{statement}\n", "planted.py")


@pytest.mark.parametrize("statement", [
    "from . import rollout, selection",
    "from .errors import check",
    "from transformers import trainer_utils",
    "import trainers",  # another package's
    "from .toy import make_toy_checkpoint",
])
def test_the_scan_leaves_other_imports_alone(statement):
    assert trainer_imports(statement, "fine.py") == []
