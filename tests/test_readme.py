"""The README is a landing page that cannot drift: short, its algorithm table generated from the registry, its code
blocks valid against the code, its commands real Makefile targets, its links to files that exist.

(The docs site's own checks, and the "Which algorithm should I use?" guide that used to live here, are
tests/test_docs.py.)"""

import dataclasses
import importlib.util
import re
from pathlib import Path

import doc_blocks

from trl_ppo_variants import algorithms

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
_spec = importlib.util.spec_from_file_location("generate", ROOT / "docs" / "_tools" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)


def test_readme_is_a_landing_page():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: the manual belongs in docs/"


def test_generated_regions_are_current():
    """README.md's algorithm table and recipes/README.md's recipe table are `docs/_tools/generate.py --write`'s."""
    assert generate.stale() == [], "stale generated region: run `python docs/_tools/generate.py --write`"


def test_algorithm_table_follows_the_registry(monkeypatch):
    """Every command of the registry has a row linking its docs page, with its paper; a new entry is a new row."""
    readme = README.read_text()
    for entry in algorithms.REGISTRY.values():
        assert f"[{entry.label}](docs/{entry.doc_page})" in readme, entry.name
        assert entry.paper.url in readme and entry.summary in readme
    first = next(iter(algorithms.REGISTRY.values()))
    added = dataclasses.replace(first, name="new_algo", label="NewAlgo", summary="a new summary")
    monkeypatch.setattr(algorithms, "REGISTRY", {**algorithms.REGISTRY, "new_algo": added})
    rewritten = generate.rewrite(readme, generate.REGIONS[README])
    assert "[NewAlgo](docs/" in rewritten and "a new summary" in rewritten and "NewAlgo" not in readme


def test_readme_code_blocks_are_valid():
    problems = doc_blocks.problems_of(README)
    assert problems == []
    assert doc_blocks.blocks(README.read_text(), "python") and doc_blocks.blocks(README.read_text(), "bash")


def test_readme_commands_are_the_makefile_targets():
    """The two commands the README gives (the main job and the tests) and the ones it names in prose exist."""
    text = README.read_text()
    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    named = set(re.findall(r"(?:^|`)make ([\w-]+)", text, flags=re.M))
    assert {"demo", "test"} <= named and named <= targets, named - targets


def test_readme_links_exist():
    for target in re.findall(r"\]\(((?!https?://)[^)#]+)(?:#[^)]*)?\)", README.read_text()):
        assert (ROOT / target).exists(), target
