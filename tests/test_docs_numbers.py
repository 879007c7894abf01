"""The docs speak with one voice: a measured number in the docs comes from bench/results, and two pages never quote
one measurement differently.

What a *quote* is, here:

- the pages are README.md and every docs/**/*.md (CHANGELOG.md, the history, may quote superseded numbers: the docs'
  changelog page includes it by a snippet line, which is not prose);
- a page's *prose* is its text less its fenced code blocks, its inline code, its HTML comments (which hold the
  `<!-- generated: NAME -->` and `<!-- results: PATH -->` markers: what the build inserts there is generated from
  bench/results and the package, not typed) and the generated regions of README.md (`<!-- generated: NAME -->` ...
  `<!-- /generated: NAME -->`);
- a quote is a number in the prose written the way the benchmark reports write a measurement: a ratio (digits, a
  point, decimals and an `x`: `1.02x`, `0.49x`) or a three-decimal fraction (`0.617`, `+0.303`): accuracies, rewards,
  differences, rates. Counts, percentages, settings (`lr 3e-5`, `beta=0.04`, `0.5x` as a target after `<=`) and
  dates are not quotes; a number right after `<=`, `>=`, `<` or `>` is a bound, not a measurement.

The rules:

1. **Sourced**: every quote is in a file under bench/results, at the precision it is quoted: the same number in a
   results report (Markdown) or a number of a results JSON file that rounds to it. The runs' own logs (a seed's
   folder, the step-by-step tables), per-step lists and timing or size keys do not count: they hold so many numbers
   that nearly any quote would match one. A measurement without a results file gets one (a transcription says where
   the number was first reported) before a page quotes it.
2. **One value per measurement**: the measurements in `MEASUREMENTS` below (each a name, its results file, how its
   value is read there and the phrasings that quote it) are quoted with the value of their results file on every page
   that quotes them, and each is quoted somewhere (an entry whose phrasing no page uses any more fails, so the table
   follows the pages). A measurement that a later run superseded is registered with the later run's file: the older
   value then fails on every page that still quotes it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
DOCS = ROOT / "docs"

#: a quote: a ratio (`1.02x`) or a three-decimal fraction (`0.617`), not part of a longer token (a version, a path,
#: a range's second end is a quote of its own), and not a bound (after `<=`, `>=`, `<`, `>`)
QUOTE = re.compile(r"(?<![\w./=<>])(?<![<>]=\s)(?<![<>]\s)(?P<n>\d+\.\d+)x(?!\w|\.\d)|"
                   r"(?<![\w./=<>])(?<![<>]=\s)(?<![<>]\s)(?P<f>0\.\d{3})(?!\w|\.\d)")


def prose(text: str) -> str:
    """A page's text less what is not prose (see the module docstring)."""
    text = re.sub(r"<!-- generated: ([\w-]+) -->[\s\S]*?<!-- /generated: \1 -->", "", text)
    text = re.sub(r"<!--[\s\S]*?-->", "", text)
    text = re.sub(r"^([ \t]*)(```|~~~)[\s\S]*?^\1\2", "", text, flags=re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def quotes(text: str) -> list[str]:
    """The quotes of a page's text, as written (`1.02x`, `0.617`)."""
    return [m[0] for m in QUOTE.finditer(prose(text))]


def pages() -> dict[str, str]:
    """page (relative to the repository) -> its text."""
    paths = [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]
    return {p.relative_to(ROOT).as_posix(): p.read_text() for p in paths}


#: JSON keys of timings and sizes (seconds, MB, clock readings): never quoted as a ratio or a fraction, and so many
#: that they would match almost any number
_NOT_QUOTED = re.compile(r"probe|wall|_s$|sec|minutes|_mb$|budget|clock|time_to|cpu|_at$")
#: the longest list of a JSON file whose numbers count (longer ones are per-step curves and logs, never quoted)
_LONGEST_LIST = 8


def _numbers(value, out: set[str], key: str = "") -> None:
    if isinstance(value, dict):
        for name, item in value.items():
            _numbers(item, out, str(name))
    elif isinstance(value, list):
        if len(value) <= _LONGEST_LIST:
            for item in value:
                _numbers(item, out, key)
    elif (isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
          and abs(value) != float("inf") and not _NOT_QUOTED.search(key)):
        out.update(f"{abs(value):.{d}f}" for d in (1, 2, 3))


def _per_run_log(path: Path) -> bool:
    """A run's own log (a seed's folder of a multi-seed run, the step-by-step tables): thousands of numbers per file,
    which the docs never quote one by one."""
    parts = path.relative_to(RESULTS).parts
    return any(part.startswith("seed") for part in parts[:-1]) or path.name.endswith("_accuracy_steps.md")


def result_numbers() -> set[str]:
    """The numbers of bench/results that a page may quote: as its reports (Markdown) write them, and as the values of
    its JSON files round (1-3 decimals), less the runs' own logs, per-step lists and timing keys (which would match
    nearly every number: with them 93% of the fractions 0.000-0.999 matched some value, without them about a third)."""
    out: set[str] = set()
    for path in RESULTS.rglob("*"):
        if _per_run_log(path):
            continue
        if path.suffix == ".md":
            out |= set(re.findall(r"\d+\.\d+", path.read_text()))
        elif path.suffix == ".json":
            _numbers(json.loads(path.read_text()), out)
    return out


def unsourced(texts: dict[str, str], numbers: set[str]) -> list[tuple[str, str]]:
    """(page, quote) for each quote of the pages that no results file holds."""
    return [(page, q) for page, text in texts.items() for q in quotes(text) if q.rstrip("x").lstrip("+") not in numbers]


# ------------------------------------------------------------------------------------------------ measurements
def _json(path: str) -> dict:
    return json.loads((RESULTS / path).read_text())


def _suite_row(path: str, name: str) -> dict:
    return next(r for r in _json(path)["results"] if r["name"] == name)


def _memory_ratio(path: str, row: str, baseline: str) -> float:
    data = _json(path)
    return data[row]["delta_mb"] / data[baseline]["delta_mb"]


def _critic_gain(variant: str) -> float:
    runs = _json("smollm2_critic/critic_learning.json")["runs"]
    gains = [run["gain"] for key, run in runs.items() if key.split("/")[0] == variant]
    return sum(gains) / len(gains)


@dataclass(frozen=True)
class Measurement:
    """One measured quantity: the results file it is read from, its value as the docs write it, and the phrasings
    (regular expressions over a page's prose, its lines joined, with a group `v` for the quoted value) that quote it."""

    source: str
    value: Callable[[], str]
    phrasings: tuple[str, ...]


TTA = "smollm2/time_to_accuracy_2026-12-06/time_to_accuracy.json"
CRITIC_MEMORY = "smollm2_critic/memory.json"  # supersedes the memory columns of the suites (allocator fixed)
CRITIC_MEMORY_3_STEPS = "smollm2_critic/memory_vapo_3steps.json"  # VAPO past its value pre-training
_R = r"(?P<v>\d+\.\d\dx)"
#: phrasings start at the measured thing and stay inside one sentence part (no `.`, `;` or table cell between)
_GAP = r"(?:[^.;|]|\.(?=\d)){0,90}?"

MEASUREMENTS: dict[str, Measurement] = {
    "ppo_full_critic_memory": Measurement(
        CRITIC_MEMORY, lambda: f"{_memory_ratio(CRITIC_MEMORY, 'ppo_ref', 'grpo_ref'):.2f}x",
        (rf"(?:PPO's|PPO,|\|) full critic:?{_GAP}{_R} (?:the |its )?(?:trainer )?memory",
         rf"full critic: [\d.]+x GRPO's on SmolLM2, {_R} its trainer memory",
         rf"PPO / VAPO:{_GAP}{_R} / [\d.]+x its trainer memory",
         rf"{_R} (?:its |the )?(?:trainer )?memory \(full critic\)",
         rf"at 1\.\d\dx the memory of GRPO with a reference model (?:against|instead of) {_R}",
         rf"memory \(1\.\d\dx against {_R}\)")),
    "ppo_lora_critic_memory": Measurement(
        CRITIC_MEMORY, lambda: f"{_memory_ratio(CRITIC_MEMORY, 'ppo_lora_ref', 'grpo_ref'):.2f}x",
        (rf"(?:PPO's default|PPO's|PPO with a|the default critic is a) LoRA critic(?: \(the default\))?:?{_GAP}{_R}",
         rf"critic{_GAP}at {_R} the memory of GRPO with a reference model")),
    "vapo_full_critic_memory": Measurement(
        CRITIC_MEMORY_3_STEPS, lambda: f"{_memory_ratio(CRITIC_MEMORY_3_STEPS, 'vapo', 'grpo'):.2f}x",
        (rf"VAPO{_GAP}{_R} (?:its |the )?(?:trainer )?memory", rf"VAPO{_GAP}(?:trainer )?memory {_R}",
         rf"full-critic VAPO is {_R}", rf"VAPO{_GAP}full critic {_R} the memory")),
    "critic_free_step_time": Measurement(
        "smollm2/suite.json",
        lambda: "{:.2f}-{:.2f}x".format(*(lambda r: (min(r), max(r)))(
            [_suite_row("smollm2/suite.json", n)["time_ratio"]
             for n in ("rloo", "remax", "reinforce_pp", "reinforce_pp_baseline")])),
        (r"critic-free trainers[^.;]{0,160}?\((?P<v>\d\.\d\d-\d\.\d\dx) its step time\)",
         r"critic-free trainers[^.;]{0,160}?take (?P<v>\d\.\d\d-\d\.\d\dx) its step time")),
    "ttrl_step_time": Measurement(
        "smollm2/suite.json", lambda: f"{_suite_row('smollm2/suite.json', 'ttrl')['time_ratio']:.2f}x",
        (rf"TTRL's vote costs(?: more on the real model \()? {_R}", rf"TTRL \(n_votes = G\) {_R}")),
    "dapo_keep_rate_toy": Measurement(
        "suite.json", lambda: f"{_suite_row('suite.json', 'dapo')['keep_rate']:.2f}",
        (r"tiny model \(keep rate (?P<v>[\d.]+)\)", r"observed keep rate of (?P<v>[\d.]+(?:-[\d.]+)?)")),
    "dapo_keep_rate_smollm2": Measurement(
        "smollm2/suite.json", lambda: f"{_suite_row('smollm2/suite.json', 'dapo')['keep_rate']:.2f}",
        (r"keep rate (?:of )?(?P<v>0\.\d+)\)? \(the share", r"(?:SmolLM2|first)[^.;]{0,40}?\(keep rate (?P<v>[\d.]+)\)")),
    "ppo_full_critic_gain_share": Measurement(
        "smollm2_critic/critic_learning.json", lambda: f"{_critic_gain('ppo') / _critic_gain('grpo'):.0%}",
        (r"the full critic (?:gets |got )?(?P<v>\d+%)(?: of GRPO's gain)?",
         r"(?P<v>learns as GRPO does)")),
    "ppo_lora_critic_gain_share": Measurement(
        "smollm2_critic/critic_learning.json", lambda: f"{_critic_gain('ppo_lora') / _critic_gain('grpo'):.0%}",
        (r"LoRA critic[^.;|]{0,40}?(?P<v>\d+%) of GRPO's (?:held-out )?gain",)),
    "tta_grpo_accuracy": Measurement(
        TTA, lambda: f"{_json(TTA)['summary']['grpo']['acc_at_budget']:.3f}",
        (r"DAPO[^.;]{0,200}?(?:ends|ended) at 0\.\d{3} against (?:GRPO's )?(?P<v>0\.\d{3})",
         r"ends its \d+ steps at a mean held-out accuracy of (?P<v>0\.\d{3})")),
    "tta_dapo_accuracy": Measurement(
        TTA, lambda: f"{_json(TTA)['summary']['dapo']['acc_at_budget']:.3f}",
        (r"DAPO reache[sd] [^.;]{0,120}? (?:and )?end(?:s|ed) at (?P<v>0\.\d{3})",
         r"seeds, (?P<v>0\.\d{3})\s+against GRPO's")),
    "tta_dapo_seeds_reached": Measurement(
        TTA, lambda: "{reached_by_half} of {seeds}".format(**_json(TTA)["summary"]["dapo"]),
        (r"DAPO reache[sd] [^.;]{0,80}?on (?P<v>\d of \d) seeds",)),
}


def disagreements(texts: dict[str, str]) -> tuple[list[str], list[str]]:
    """(each quote of a registered measurement that differs from its results file, each measurement no page
    quotes)."""
    wrong, unquoted = [], []
    for name, measurement in MEASUREMENTS.items():
        value, found = measurement.value(), 0
        for page, text in texts.items():
            flat = " ".join(prose(text).split())
            for phrasing in measurement.phrasings:
                for match in re.finditer(phrasing, flat):
                    found += 1
                    if match["v"] != value:
                        wrong.append(f"{page}: {name} quoted as {match['v']!r}, bench/results/{measurement.source} "
                                     f"says {value!r} (in {match[0]!r})")
        if not found:
            unquoted.append(name)
    return wrong, unquoted


# ------------------------------------------------------------------------------------------------ tests
def test_the_definition_of_a_quote():
    text = """Costs 1.02x, ends at 0.617 (+0.303) against `0.999` and 2.5x.

```text
0.123 1.11x
```
<!-- generated: algorithms -->
0.456
<!-- /generated: algorithms -->
A target: <= 0.6x, version 1.16.0, lr 3e-5, 12%, 0.5 and 0.12 are no quotes; 0.43-0.83 is two.
"""
    assert quotes(text) == ["1.02x", "0.617", "0.303", "2.5x"]
    assert quotes("from 0.430-0.830 on") == ["0.430", "0.830"]


def test_a_quote_missing_from_bench_results_fails():
    numbers = result_numbers()
    assert {"1.74x".rstrip("x"), "0.617", "0.314"} <= numbers  # read from the reports and the JSON files
    assert unsourced({"page.md": "DAPO ends at 0.617 at 1.74x."}, numbers) == []
    absent = next(f"0.{i:03d}" for i in range(1000) if f"0.{i:03d}" not in numbers)  # a fraction no file holds
    assert unsourced({"page.md": f"DAPO ends at {absent} at 123.45x."}, numbers) == [("page.md", absent),
                                                                                   ("page.md", "123.45x")]


def test_every_quote_is_in_bench_results():
    missing = unsourced(pages(), result_numbers())
    assert missing == [], "quotes found in no file of bench/results: " + ", ".join(f"{p}: {q}" for p, q in missing)


def test_a_measurement_quoted_differently_fails():
    value = MEASUREMENTS["ppo_full_critic_memory"].value()
    wrong, _ = disagreements({"a.md": f"PPO's full critic: {value} the memory of GRPO with a reference model",
                              "b.md": "PPO's full critic: 9.99x the memory of GRPO with a reference model"})
    assert len(wrong) == 1 and wrong[0].startswith("b.md: ppo_full_critic_memory quoted as '9.99x'")


def test_every_page_quotes_each_measurement_as_its_results_file():
    wrong, unquoted = disagreements(pages())
    assert wrong == [], "\n".join(wrong)
    assert unquoted == [], f"registered measurements that no page quotes any more (update MEASUREMENTS): {unquoted}"
