"""README sections that must follow the code and the measurements: the "Which algorithm should I use?" guide
(`bench/guide.py`: generated from the repository's measured numbers, never edited by hand, so that rerunning a
benchmark or a demo and `python bench/guide.py --write` updates it) and the table of logged metrics."""

import copy
import importlib.util
import json
import re
from pathlib import Path

from trl_ppo_variants import cli

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("guide", ROOT / "bench" / "guide.py")
guide = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(guide)


def _suites():
    return json.loads(guide.REAL_SUITE.read_text()), json.loads(guide.TOY_SUITE.read_text())


def _squash(text: str) -> str:
    return " ".join(text.split())


def test_readme_guide_is_the_generated_one():
    readme = guide.README.read_text()
    expected = guide.render(readme, *_suites())
    assert expected in readme, "README.md's guide is stale: run `python bench/guide.py --write`"


def test_numbers_stated_in_prose_are_the_readmes():
    """Each number the guide takes from the README's prose is there, outside the guide (reflowed lines allowed)."""
    text = _squash(guide.strip_guide(guide.README.read_text()))
    for name, (quoted, shown) in guide.PROSE_NUMBERS.items():
        assert _squash(quoted) in text, (name, quoted)
        for number in re.findall(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?", shown):  # what the guide shows is quoted
            assert number in quoted, (name, number, quoted)


def test_every_command_has_a_row_and_every_measurement_is_read():
    names = [row[0] for row in guide.GUIDE]
    assert sorted(names) == sorted([*cli.ALGORITHMS, *cli.BASELINES])
    readme = guide.strip_guide(guide.README.read_text())
    toy = guide.toy_results(readme)
    assert set(toy) == set(cli.ALGORITHMS) and all(0 <= b <= 1 and 0 <= a <= 1 for b, a in toy.values())
    demo = guide.demo_results(readme)
    assert {"grpo", "dapo"} <= set(demo)
    for before, after, gain in demo.values():
        assert abs(after - before - gain) < 1.5e-3


def test_the_guide_follows_the_numbers():
    """Change a benchmark number or a demo result and the guide says the new one."""
    readme = guide.README.read_text()
    real, toy = _suites()
    changed = copy.deepcopy(real)
    row = next(r for r in changed["results"] if r["name"] == "ppo")
    row["time_ratio"], row["mem_ratio"] = 2.345, 1.987
    text = guide.render(readme, changed, toy)
    assert "2.35x time, 1.99x memory" in text and "2.35x time, 1.99x memory" not in guide.render(readme, real, toy)
    rewritten = re.sub(r"^dapo(\s+)0\.47 -> [\d.]+", r"dapo\g<1>0.47 -> 0.99", guide.strip_guide(readme), flags=re.M)
    assert "toy 0.47 -> 0.99" in guide.render(rewritten, real, toy)


# ------------------------------------------------------------------------------------------------ logged metrics
#: metrics logged under a computed name, and how the README's table names them
DYNAMIC_METRICS = {"ttrl/{prefix}/{name}": "ttrl/votes/", "rewards/{name}/non_finite": "rewards/<function>/non_finite"}


#: TRL's own metrics that a trainer of this package logs a value of (not additions: the prose names them)
TRL_METRICS = {"frac_reward_zero_std"}


def _logged_metric_names() -> set[str]:
    """Every metric name the package's code logs with a literal key (`_metrics[...]["name"]`, DAPO's
    `metrics["name"]`, the critic warm-up flags)."""
    names = set()
    for path in (ROOT / "trl_ppo_variants").rglob("*.py"):
        text = path.read_text()
        names |= set(re.findall(r"(?:_metrics\[[^\]]+\]|\bmetrics)\[f?\"([^\"]+)\"\]\.(?:append|extend)", text))
        names |= set(re.findall(r"^\s+warmup_metric = \"(\w+)\"", text, flags=re.M))
    # the prompt selection logs `<prefix>/<name>` (`selection/`, DAPO's `dapo/`) from one dict and GRESO's update
    text = (ROOT / "trl_ppo_variants" / "screening.py").read_text()
    block = text[text.index("        values = {"): text.index("        for name, value in values.items():")]
    keys = (re.findall(r"^\s+\"(\w+)\": ", block, flags=re.M) + re.findall(r"\bvalues\[\"(\w+)\"\] = ", block)
            + re.findall(r"\b(greso_\w+)=", block))
    names |= {f"selection/{key}" for key in keys}
    names.discard("{p}/{name}")  # that loop's own key, expanded above
    return names


def test_every_logged_metric_is_in_the_readme_table():
    """The README's Logging table names every metric a trainer of this package adds (a new metric gets a row)."""
    readme = guide.README.read_text()
    table = readme[readme.index("## Logging"):]
    table = table[: table.index("\n## ")]
    documented = set(re.findall(r"`([^`]+)`", "\n".join(l for l in table.splitlines() if l.startswith("| `"))))
    names = _logged_metric_names()
    assert {"selection/rounds", "selection/greso_p_easy", "value/explained_variance", "remax/greedy_reward", "critic_warmup"} <= names  # the scan
    for name in names:
        if name in TRL_METRICS:  # TRL's own metric, restated by a trainer (SPEED's rounds): named in the prose
            assert f"`{name}`" in readme[readme.index("## Logging"):], name
        elif name in DYNAMIC_METRICS:
            assert any(d.startswith(DYNAMIC_METRICS[name]) for d in documented), name
        else:
            assert name in documented, f"metric {name!r} is logged but not in the README table"
    from trl_ppo_variants.rewards import vote_statistics

    for stat in [*vote_statistics([1.0, 0.0], 2, [1.0, 0.0], [True]), "no_answer_frac"]:
        assert any(f"ttrl/votes/{stat}" in d for d in documented), stat
