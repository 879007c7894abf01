"""The docs' "Which algorithm should I use?" guide (docs/guide.md), built from numbers measured elsewhere in this
repository.

    python bench/guide.py            # print the guide
    python bench/guide.py --write    # replace the guide between its markers in docs/guide.md

Nothing in the guide is typed by hand twice. Its numbers come from:

- the benchmark results (`bench/results/smollm2/suite.json`, `bench/results/suite.json`: step time and trainer memory
  against TRL's `GRPOTrainer`, DAPO's rounds and generated tokens per trained token): rerun `make bench`, then this;
- the critics' memory (`bench/results/smollm2_critic/memory*.json`, `CRITIC_MEMORY`): measured with the allocator's
  mmap threshold fixed, which superseded the suite's memory columns for PPO and VAPO;
- the demo tables of docs/getting-started.md ("The main job": held-out accuracy gains on SmolLM2-135M-Instruct; "The
  quick path": the toy reward after 40 steps), read from that page: rerun the demo, paste its table, then this;
- `PROSE_NUMBERS` below: the measurements the docs state in prose (the 10-step run of every trainer on the real
  model, TTRL's first measurement, the process-supervision digits task, the critic's tables). Each must appear
  verbatim in a docs page other than the guide, which `tests/test_docs.py` checks, as it checks that docs/guide.md
  holds this script's output.

What is not a number (when to pick an algorithm, the paper's own setting, the caveat, and which measurements to show)
is each algorithm's own: the `guide:` entry of its page's front matter (docs/algorithms/*.md), one row per command of
`trl_ppo_variants.algorithms.REGISTRY`, in the registry's order.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from a clone
    sys.path.insert(0, str(ROOT))

from trl_ppo_variants import algorithms  # noqa: E402  (imports nothing heavy)

DOCS = ROOT / "docs"
GUIDE_PAGE = DOCS / "guide.md"
DEMO_PAGE = DOCS / "getting-started.md"
REAL_SUITE = ROOT / "bench" / "results" / "smollm2" / "suite.json"
TOY_SUITE = ROOT / "bench" / "results" / "suite.json"
#: the multi-seed time-to-accuracy reports of the demo's protocol (`bench/time_to_accuracy.py --seeds`), in folders
#: named time_to_accuracy_<date>; the guide reads the newest. Other protocols (time_to_accuracy_g16_<date>) do not
#: match.
TTA_REPORTS = "bench/results/smollm2/time_to_accuracy_[0-9]*/time_to_accuracy.json"
CRITIC_RESULTS = ROOT / "bench" / "results" / "smollm2_critic"
#: the critics' trainer memory: name -> (results file, its row, the baseline row, what the baseline is)
CRITIC_MEMORY = {
    "ppo": ("memory.json", "ppo_ref", "grpo_ref", "with a reference model"),
    "ppo_lora": ("memory.json", "ppo_lora_ref", "grpo_ref", "with a reference model"),
    # past the value pre-training (3 steps): the policy's Adam state exists from the step after it
    "vapo": ("memory_vapo_3steps.json", "vapo", "grpo", "without a reference model"),
}
WIDTH = 118  # the docs' prose width
BEGIN = "<!-- guide: written by `python bench/guide.py --write` from the docs' measurements and bench/results; edit it there -->"
END = "<!-- /guide -->"
#: the demo tables of DEMO_PAGE, by the heading above each
DEMO_HEADING = "## The main job: `make demo`"
TOY_HEADING = "## The quick path: `make demo-toy`"

#: measurements the docs state in prose: name -> (the text as a docs page has it, the value shown in the guide)
PROSE_NUMBERS = {
    "grpo_10": ("0.104 -> 0.786", "0.104 -> 0.786"),
    "vapo_10": ("(10 steps, 5 value pre-training steps): 0.104 -> 0.714", "0.104 -> 0.714"),
    "remax_10": ("0.104 -> 0.297, 28% of GRPO's gain", "0.104 -> 0.297"),
    "remax_greedy": ("greedy reward 0.5-1.0 while the sampled reward is 0-0.38", "greedy 0.5-1.0, samples 0-0.38"),
    "process_steps": ("ends at 0.481-0.512 held-out digit accuracy", "0.481-0.512"),
    "process_outcome": ("against 0.081-0.391 with only the exact-answer outcome reward", "0.081-0.391"),
    "dapo_keep": ("(keep rate 0.28)", "0.28"),
    "ppo_lora_mem": ("| PPO, LoRA critic over the reference's weights | 3772 | 1.02x |", "1.02x"),
    "vapo_lora_mem": ("| VAPO, LoRA critic (frozen copy), 3 steps | 3798 | 1.02x |", "1.02x"),
    "ppo_lora_gain": ("| +0.119 | 555% | 127% |", "127%"),
    "ppo_full_gain": ("| +0.021 | 100% | 23% |", "23%"),
    "vapo_lora_gain": ("| +0.035 | 23% | 33% |", "23%"),
}

#: the keys of a page's `guide:` entry, in the table's order
ROW_KEYS = ("when", "paper", "measured", "watch")


def front_matter(text: str) -> dict:
    """The YAML front matter of a docs page ({} when it has none)."""
    match = re.match(r"^---\n([\s\S]*?)\n---\n", text)
    return yaml.safe_load(match.group(1)) or {} if match else {}


def guide_rows() -> list[tuple[str, dict]]:
    """(command, its `guide:` entry) for every command of the registry, from its algorithm page."""
    rows = []
    for entry in algorithms.REGISTRY.values():
        row = front_matter((DOCS / entry.doc_page).read_text()).get("guide", {}).get(entry.name)
        if row is None or set(row) != set(ROW_KEYS):
            raise ValueError(f"docs/{entry.doc_page}: its front matter needs `guide: {entry.name}:` with {ROW_KEYS}")
        rows.append((entry.name, row))
    return rows


def prose_pages() -> str:
    """Every docs page but the guide, joined: where PROSE_NUMBERS are stated."""
    return "\n".join(p.read_text() for p in sorted(DOCS.rglob("*.md")) if p != GUIDE_PAGE)


# ------------------------------------------------------------------------------------------------ sources
def _code_block_after(text: str, heading: str) -> str:
    start = text.index(heading)
    block = text.index("```", start)
    return text[block + 3 : text.index("```", block + 3)]


def toy_results(page: str) -> dict[str, tuple[float, float]]:
    """algorithm -> (reward before, after) from the toy-demo table of the getting-started page."""
    block = _code_block_after(page, TOY_HEADING)
    rows = re.findall(r"^(\w+)\s+([\d.]+) -> ([\d.]+)\s+[\d.]+\s*$", block, flags=re.M)
    return {name: (float(before), float(after)) for name, before, after in rows}


def demo_results(page: str) -> dict[str, tuple[float, float, float]]:
    """algorithm -> (held-out accuracy before, after, gain) from the real-model demo table of the same page."""
    block = _code_block_after(page, DEMO_HEADING)
    rows = re.findall(r"^(\w+)(?: \([^)]*\))?\s+([\d.]+) -> ([\d.]+)\s+([+-][\d.]+)\s", block, flags=re.M)
    return {name: (float(b), float(a), float(g)) for name, b, a, g in rows}


def suite_rows(suite: dict) -> dict[str, dict]:
    return {r["name"]: r for r in suite["results"] if r.get("status") == "ok"}


def critic_free(real: dict) -> list[algorithms.Algorithm]:
    """The algorithms that cost about what GRPO costs: no critic, no reward of their own (TTRL's vote is a cost of its
    own), one generation round per step (DAPO's dynamic sampling generates more), measured in the real-model suite."""
    return [a for a in algorithms.ALGORITHMS.values() if not a.critic and not a.own_reward and not a.baseline
            and a.name in real and real[a.name].get("rounds_per_step", 1.0) <= 1.0]


def critic_memory() -> dict[str, tuple[float, str]]:
    """name -> (trainer memory against GRPO's, what GRPO ran with) for the critics (`CRITIC_MEMORY`)."""
    out = {}
    for name, (path, row, base, what) in CRITIC_MEMORY.items():
        data = json.loads((CRITIC_RESULTS / path).read_text())
        out[name] = (data[row]["delta_mb"] / data[base]["delta_mb"], what)
    return out


def _memory(memory: dict, name: str) -> str:
    ratio, what = memory[name]
    return f"{ratio:.2f}x the memory of GRPO {what}"


# ------------------------------------------------------------------------------------------------ the guide
def _cost(entry: algorithms.Algorithm, real: dict, toy: dict, memory: dict) -> str:
    if entry.baseline:
        return "1.00x (the reference)"
    row = real.get(entry.name)
    if row is None:
        toy_row = toy.get(entry.name)
        return f"not benchmarked on SmolLM2; toy {toy_row['time_ratio']:.2f}x time" if toy_row else "not benchmarked"
    text = f"{row['time_ratio']:.2f}x time, {row['mem_ratio']:.2f}x memory"
    if entry.critic and entry.name in memory:
        text = f"{row['time_ratio']:.2f}x time, {_memory(memory, entry.name)}"
        if entry.name == "ppo":  # the suite's PPO row and its memory are the full critic's (PPO's default: LoRA)
            text = (f"full critic: {row['time_ratio']:.2f}x time, {_memory(memory, 'ppo')}; LoRA critic (the "
                    f"default): {_memory(memory, 'ppo_lora')}")
    if row.get("rounds_per_step", 1.0) > 1.0:
        text += (f"; {row['rounds_per_step']:.2f} generation rounds per step, {row['gen_per_trained_token']:.2f} "
                 "generated tokens per trained token")
    return text


def load_tta() -> dict | None:
    """The newest multi-seed time-to-accuracy report (`TTA_REPORTS`), or None when there is none."""
    paths = sorted(ROOT.glob(TTA_REPORTS))
    return json.loads(paths[-1].read_text()) if paths else None


def tta_sentence(report: dict) -> str:
    """One sentence per method of a multi-seed time-to-accuracy report: on how many seeds it reached the reference's
    accuracy by half the reference's time, and its mean accuracy at that budget against the reference's. A method
    run on fewer seeds than the reference (a variant tried on some) is left to the benchmarks page."""
    ref, summary, labels = report["methods"][0], report["summary"], report["labels"]
    seeds = summary[ref]["seeds"]
    parts = [f"{labels[m]} reached it by half that time on {summary[m]['reached_by_half']} of {summary[m]['seeds']} "
             f"seeds (median {summary[m]['time_ratio_median']:.2f}x) and ended at {summary[m]['acc_at_budget']:.3f}"
             for m in report["methods"][1:] if m in summary and summary[m]["seeds"] == seeds]
    return (f"Time to accuracy over {seeds} seeds (SmolLM2-135M-Instruct, the demo's settings; "
            f"[Benchmarks](benchmarks/time-to-accuracy.md#time-to-accuracy-over-seeds)): {labels[ref]} ends its "
            f"{report['protocol']['grpo_steps']} steps at a mean "
            f"held-out accuracy of {summary[ref]['acc_at_budget']:.3f}; " + "; ".join(parts) + " in the same time.")


def render(demo_page: str, real_suite: dict, toy_suite: dict, rows: list[tuple[str, dict]] | None = None,
           tta: dict | None = None, memory: dict | None = None) -> str:
    """The guide's Markdown (between its markers) from the demo page, the two suites and the pages' guide rows."""
    rows = guide_rows() if rows is None else rows
    memory = critic_memory() if memory is None else memory
    values = {name: shown for name, (_, shown) in PROSE_NUMBERS.items()}
    for name, (before, after) in toy_results(demo_page).items():
        values[f"toy_{name}"] = f"{before:.2f} -> {after:.2f}"
    for name, (before, after, gain) in demo_results(demo_page).items():
        values[f"demo_{name}"] = f"{before:.3f} -> {after:.3f} ({gain:+.3f})"
    real, toy = suite_rows(real_suite), suite_rows(toy_suite)
    baseline = algorithms.BASELINE
    intro = (
        f"Start from TRL's {baseline.label} (`trl-ppo-variants {baseline.name}`) or RLOO, and switch when your setting"
        " is the one an algorithm was made for. \"Measured here\" is this repository's own numbers: the real model is"
        " SmolLM2-135M-Instruct on arithmetic word problems (held-out accuracy, one seed: the 10-step run of every"
        " trainer, on the algorithms' pages, and `make demo`), the toy is `make demo-toy` (sampled reward after 40"
        " steps; both on [Getting started](getting-started.md)). Costs are `make bench-smollm2`"
        f" ({real_suite['machine']['date']}, {real_suite['machine']['cores']} CPU cores, ratios to TRL's `GRPOTrainer`"
        " in the same run; on a GPU the critic's memory matters more than its time; [Benchmarks](benchmarks/index.md))."
        " Small runs on small models: they show direction and cost, not a ranking."
    )
    lines = [
        BEGIN,
        "",
        textwrap.fill(intro, WIDTH),
        "",
        "| pick | when | the paper's setting | measured here | cost vs GRPO (SmolLM2-135M) | watch |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in rows:
        entry = algorithms.REGISTRY[name]
        lines.append(f"| [`{name}`]({entry.doc_page}) | {row['when']} | {row['paper']} | "
                     f"{row['measured'].format(**values)} | {_cost(entry, real, toy, memory)} | {row['watch'].format(**values)} |")
    free = critic_free(real)
    ratios = [real[a.name]["time_ratio"] for a in free]
    critics = [a for a in algorithms.ALGORITHMS.values() if a.critic and a.name in real]
    own = [a for a in algorithms.ALGORITHMS.values() if a.own_reward and a.name in real]
    keep_rounds = [real[a.name]["rounds_per_step"] for a in algorithms.ALGORITHMS.values()
                   if a.name in real and real[a.name].get("rounds_per_step", 1.0) > 1.0]
    costs = (
        f"Costs in one line: the critic-free trainers ({', '.join(a.label for a in free)}) cost about what"
        f" {baseline.label} costs" + (f" ({min(ratios):.2f}-{max(ratios):.2f}x its step time)" if ratios else "")
        + "".join(f"; {a.label}'s vote costs {real[a.name]['time_ratio']:.2f}x {baseline.label}'s step time" for a in own)
        + (f"; {' and '.join(a.label for a in critics)} with a full critic hold a second full model with its optimizer"
           f" state ({'; '.join(f'{a.label}, {_cost(a, real, toy, memory)}' for a in critics)})" if critics else "")
        + f"; DAPO pays in generation: at a keep rate of {values['dapo_keep']} (the share of groups with a reward"
        " spread)" + (f" it needed {keep_rounds[0]:.2f} rounds per step" if keep_rounds else "")
        + ", fewer when the data suits the model."
    )
    lines += ["", textwrap.fill(costs, WIDTH), ""]
    if tta is not None:
        # a link must stay on one line: no break at its hyphens
        lines += [textwrap.fill(tta_sentence(tta), WIDTH, break_on_hyphens=False, break_long_words=False), ""]
    lines += [END]
    return "\n".join(lines)


def replace_guide(page: str, guide: str) -> str:
    if BEGIN not in page or END not in page:
        raise ValueError(f"{GUIDE_PAGE} has no guide markers ({BEGIN!r} ... {END!r})")
    return page[: page.index(BEGIN)] + guide + page[page.index(END) + len(END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="replace the guide in docs/guide.md")
    opts = parser.parse_args(argv)
    guide = render(DEMO_PAGE.read_text(), json.loads(REAL_SUITE.read_text()), json.loads(TOY_SUITE.read_text()),
                   tta=load_tta())
    if opts.write:
        GUIDE_PAGE.write_text(replace_guide(GUIDE_PAGE.read_text(), guide))
        print(f"guide written to {GUIDE_PAGE}")
    else:
        print(guide)
    return 0


if __name__ == "__main__":
    sys.exit(main())
