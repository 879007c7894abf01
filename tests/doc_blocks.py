"""Checks of the code blocks of the README and of the docs pages (used by tests/test_readme.py and tests/test_docs.py).

A Python block must compile, every name it imports from `trl_ppo_variants` must exist, and every keyword it passes to
one of the package's configs must be a field of that config: the examples cannot drift from the code silently. They
are not run (they train Qwen3 from the Hub). A bash block's `make` targets must be targets of the Makefile, its
`trl-ppo-variants <command>` a command of the package, and its `recipes/...` files must exist.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

from trl_ppo_variants import algorithms, cli

ROOT = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?P<indent> *)```(?P<lang>[\w-]*)[^\n]*\n(?P<body>.*?)^(?P=indent)```", re.M | re.S)


def blocks(text: str, lang: str) -> list[str]:
    """The fenced blocks of `text` in language `lang`, dedented."""
    out = []
    for match in FENCE.finditer(text):
        if match["lang"] == lang:
            indent = len(match["indent"])
            out.append("\n".join(line[indent:] for line in match["body"].splitlines()))
    return out


def _config_fields() -> dict[str, set[str]]:
    """Public config class name -> its dataclass fields (TRL's included)."""
    fields = {}
    for name, module in algorithms.exports().items():
        if name.endswith("Config"):
            cls = getattr(importlib.import_module(f"{algorithms.PACKAGE}.{module}"), name)
            fields[name] = {f.name for f in dataclasses.fields(cls)}
    return fields


def python_problems(code: str) -> list[str]:
    """What is wrong with one Python block ([] when nothing is)."""
    try:
        tree = ast.parse(code)
    except SyntaxError as error:
        return [f"does not compile: {error}"]
    problems = []
    configs = _config_fields()
    local = {name: name for name in configs}  # blocks that show a config call without its import mean the package's
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == algorithms.PACKAGE:
            module = importlib.import_module(node.module)
            for alias in node.names:
                if not hasattr(module, alias.name):
                    problems.append(f"`from {node.module} import {alias.name}`: no such name")
                elif alias.name in configs:
                    local[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module == "trl":
            for alias in node.names:  # TRL's own config: not this package's
                local.pop(alias.asname or alias.name, None)
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in local:
            config = local[node.func.id]
            for keyword in node.keywords:
                if keyword.arg is not None and keyword.arg not in configs[config]:
                    problems.append(f"{config}({keyword.arg}=...): not a field of {config}")
    return problems


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))


def bash_problems(code: str) -> list[str]:
    """What is wrong with one bash block ([] when nothing is)."""
    problems = []
    targets = _make_targets()
    commands = set(algorithms.REGISTRY) | set(cli.COMMANDS)
    for line in code.splitlines():
        line = line.split("#", 1)[0]
        for target in re.findall(r"(?:^|\s)make ([\w-]+)", line):
            if target not in targets:
                problems.append(f"`make {target}`: no such Makefile target")
        for command in re.findall(r"(?:trl-ppo-variants|-m trl_ppo_variants) ([a-z][\w-]*)", line):
            if command not in commands:
                problems.append(f"`trl-ppo-variants {command}`: no such command")
        for path in re.findall(r"(recipes/[\w/.-]+\.yaml)", line):
            if not (ROOT / path).exists():
                problems.append(f"{path}: no such file")
    return problems


def problems_of(path: Path) -> list[str]:
    text = path.read_text()
    found = [f"{path.name}, python block {i}: {p}" for i, code in enumerate(blocks(text, "python"))
             for p in python_problems(code)]
    found += [f"{path.name}, bash block {i}: {p}" for i, code in enumerate(blocks(text, "bash"))
              for p in bash_problems(code)]
    return found
