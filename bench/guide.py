"""The README's "Which algorithm should I use?" guide, built from numbers measured elsewhere in this repository.

    python bench/guide.py            # print the guide
    python bench/guide.py --write    # replace the guide between its markers in README.md

Nothing in the guide is typed by hand twice. Its numbers come from:

- the benchmark results (`bench/results/smollm2/suite.json`, `bench/results/suite.json`: step time and trainer memory
  against TRL's `GRPOTrainer`, DAPO's rounds and generated tokens per trained token): rerun `make bench`, then this;
- the README's own demo tables ("What `make demo` printed": held-out accuracy gains on SmolLM2-135M-Instruct; "The
  quick path": the toy reward after 40 steps), read from the README itself: rerun the demo, paste its table, then this;
- `PROSE_NUMBERS` below: the measurements the README states in prose (the 10-step run of every trainer on the real
  model, TTRL's first measurement, the process-supervision digits task). Each must appear verbatim in the README
  (outside the guide), which `tests/test_guide.py` checks, as it checks that the README's guide is this script's
  output.

What is not a number (when to pick an algorithm: the paper's own setting, and the caveat) is `GUIDE`, below.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
REAL_SUITE = ROOT / "bench" / "results" / "smollm2" / "suite.json"
TOY_SUITE = ROOT / "bench" / "results" / "suite.json"
WIDTH = 118  # the README's prose width
#: the trainers without a critic, whose cost the summary line gives as one range
CRITIC_FREE = ("rloo", "remax", "reinforce_pp", "reinforce_pp_baseline", "ttrl")
BEGIN = "<!-- guide: written by `python bench/guide.py --write` from the README's measurements and bench/results; edit it there -->"
END = "<!-- /guide -->"

#: measurements the README states in prose: name -> (the text as the README has it, the value shown in the guide)
PROSE_NUMBERS = {
    "grpo_10": ("0.104 -> 0.786", "0.104 -> 0.786"),
    "ppo_10": ("0.104 -> 0.776", "0.104 -> 0.776"),
    "vapo_10": ("VAPO with 5 value pre-training steps: 0.104 -> 0.714", "0.104 -> 0.714"),
    "remax_10": ("0.104 -> 0.297, 28% of GRPO's gain", "0.104 -> 0.297"),
    "remax_greedy": ("greedy reward 0.5-1.0 while the sampled reward is 0-0.38", "greedy 0.5-1.0, samples 0-0.38"),
    "ttrl_first": ("held-out accuracy from 0.042", "0.042"),
    "ttrl_first_after": ("TTRL falling (0.031)", "0.031"),
    "process_steps": ("ends at 0.481-0.512 held-out digit accuracy", "0.481-0.512"),
    "process_outcome": ("against 0.081-0.391 with only the exact-answer outcome reward", "0.081-0.391"),
    "dapo_keep": ("(keep rate 0.28)", "0.28"),
    "ppo_lora_mem": ("| PPO, LoRA critic over the reference's weights | 3772 | 1.02x |", "1.02x"),
    "vapo_lora_mem": ("| VAPO, LoRA critic (frozen copy), 3 steps | 3798 | 1.02x |", "1.02x"),
    "ppo_lora_gain": ("| +0.119 | 555% | 127% |", "127%"),
    "ppo_full_gain": ("| +0.021 | 100% | 23% |", "23%"),
    "vapo_lora_gain": ("| +0.035 | 23% | 33% |", "23%"),
}

#: one row per choice: (command name, when to pick it, the paper's setting, what to watch; `{...}` are numbers)
GUIDE = [
    ("grpo", "you want the baseline: a verifiable reward and groups of samples per prompt",
     "DeepSeekMath (math, G = 64)",
     "TRL's own `GRPOTrainer` (`trl-ppo-variants grpo`): what every row here is compared with",
     "real model, 10 steps: {grpo_10}; demo: {demo_grpo}"),
    ("rloo", "you want GRPO's simplicity with an unbiased leave-one-out baseline, or a KL in the reward",
     "RLHF with a reward model, k = 2-4 samples",
     "the KL in the reward costs no extra forward here (TRL's `RLOOTrainer` pays one)",
     "toy {toy_rloo}"),
    ("reinforce_pp", "you would rather see many prompts once than few prompts many times",
     "one sample per prompt, advantages whitened over the batch, KL in the reward",
     "no per-prompt baseline: it relies on large batches",
     "demo: {demo_reinforce_pp}; toy {toy_reinforce_pp}"),
    ("reinforce_pp_baseline", "you keep groups of samples and want REINFORCE++'s global normalisation and k2 KL",
     "reasoning with groups (the paper's -baseline variant)", "",
     "toy {toy_reinforce_pp_baseline}"),
    ("dapo", "most groups come back all right or all wrong (data too hard or too easy), or completions are long",
     "long chain-of-thought math (AIME, Qwen2.5-32B, 20k tokens)",
     "dynamic sampling generates extra rounds to fill the batch with groups that have a reward spread",
     "demo: {demo_dapo} (the largest gain); toy {toy_dapo}"),
    ("remax", "greedy decoding scores close to the mean of your samples (the paper's assumption)",
     "RLHF with a reward model, one sample + the greedy one per prompt",
     "when greedy is much better than samples the baseline sits above nearly every sample: on SmolLM2 "
     "({remax_greedy}) it learned {remax_10} against GRPO's {grpo_10}",
     "real model, 10 steps: {remax_10}; toy {toy_remax}"),
    ("ppo", "you want token-level credit assignment from a learned critic (long completions, step rewards)",
     "classic RLHF (InstructGPT)",
     "the default critic is a LoRA adapter and a head over frozen weights ({ppo_lora_mem} the memory of GRPO with a "
     "reference model; on SmolLM2 {ppo_lora_gain} of GRPO's held-out gain over four seeds, the full critic "
     "{ppo_full_gain}); `critic_backbone=\"full\"` trains a second full model with its optimizer state (the cost "
     "shown)",
     "real model, 10 steps: {ppo_10} (full critic); toy {toy_ppo} (full critic)"),
    ("vapo", "long chains of thought where GRPO's sequence-level advantage is too coarse",
     "long-CoT reasoning (AIME 2024, Qwen2.5-32B), value pre-training",
     "a full critic's cost (VAPO's default, as PPO's `critic_backbone=\"full\"`) plus value pre-training steps; "
     "`critic_backbone=\"lora\"`: {vapo_lora_mem} the memory of GRPO with a reference model, but on 24-token "
     "completions {vapo_lora_gain} of the full critic's gain "
     "(the length-adaptive lambda makes the advantages one-step TD errors of the critic)",
     "real model, 10 steps: {vapo_10}; toy {toy_vapo}"),
    ("ttrl", "you have no labels and the model's majority answer is usually right",
     "test-time RL on math benchmarks with strong models (Qwen2.5-Math-7B)",
     "on a weak model it reinforces a wrong majority: SmolLM2 (3-12% of samples right) fell from "
     "{ttrl_first} to {ttrl_first_after}; label-free: a reward reading the ground truth is refused",
     "toy {toy_ttrl} (at lr 1e-4)"),
    ("process_grpo", "you can score each step (a process reward model or a step checker)",
     "DeepSeekMath's process supervision (math, a PRM)",
     "a PRM is another model to run on every completion",
     "digits task: {process_steps} with step rewards vs {process_outcome} outcome only; toy {toy_process_grpo}"),
]


# ------------------------------------------------------------------------------------------------ sources
def strip_guide(readme: str) -> str:
    """The README without its generated guide (the sources must not be read from the guide itself)."""
    if BEGIN in readme and END in readme:
        return readme[: readme.index(BEGIN)] + readme[readme.index(END) + len(END):]
    return readme


def _code_block_after(readme: str, heading: str) -> str:
    start = readme.index(heading)
    block = readme.index("```", start)
    return readme[block + 3 : readme.index("```", block + 3)]


def toy_results(readme: str) -> dict[str, tuple[float, float]]:
    """algorithm -> (reward before, after) from the README's toy-demo table ("The quick path")."""
    block = _code_block_after(readme, "### The quick path")
    rows = re.findall(r"^(\w+)\s+([\d.]+) -> ([\d.]+)\s+[\d.]+\s*$", block, flags=re.M)
    return {name: (float(before), float(after)) for name, before, after in rows}


def demo_results(readme: str) -> dict[str, tuple[float, float, float]]:
    """algorithm -> (held-out accuracy before, after, gain) from the README's real-model demo table."""
    block = _code_block_after(readme, "### What `make demo` printed")
    rows = re.findall(r"^(\w+)(?: \([^)]*\))?\s+([\d.]+) -> ([\d.]+)\s+([+-][\d.]+)\s", block, flags=re.M)
    return {name: (float(b), float(a), float(g)) for name, b, a, g in rows}


def suite_rows(suite: dict) -> dict[str, dict]:
    return {r["name"]: r for r in suite["results"] if r.get("status") == "ok"}


# ------------------------------------------------------------------------------------------------ the guide
def _cost(name: str, real: dict, toy: dict) -> str:
    row = real.get(name)
    if name == "grpo":
        return "1.00x (the reference)"
    if row is None:
        toy_row = toy.get(name)
        return f"not benchmarked on SmolLM2; toy {toy_row['time_ratio']:.2f}x time" if toy_row else "not benchmarked"
    text = f"{row['time_ratio']:.2f}x time, {row['mem_ratio']:.2f}x memory"
    if name == "ppo":  # the suite's PPO row is the full critic's (PPO's default is the LoRA critic)
        text += " (full critic)"
    if name == "dapo":
        text += (f"; {row['rounds_per_step']:.2f} generation rounds per step, {row['gen_per_trained_token']:.2f} "
                 "generated tokens per trained token")
    return text


def render(readme: str, real_suite: dict, toy_suite: dict) -> str:
    """The guide's Markdown (between its markers) from the README (without its guide) and the two suites."""
    readme = strip_guide(readme)
    values = {name: shown for name, (_, shown) in PROSE_NUMBERS.items()}
    for name, (before, after) in toy_results(readme).items():
        values[f"toy_{name}"] = f"{before:.2f} -> {after:.2f}"
    for name, (before, after, gain) in demo_results(readme).items():
        values[f"demo_{name}"] = f"{before:.3f} -> {after:.3f} ({gain:+.3f})"
    real, toy = suite_rows(real_suite), suite_rows(toy_suite)
    intro = (
        "Start from TRL's GRPO (`trl-ppo-variants grpo`) or RLOO, and switch when your setting is the one an algorithm"
        " was made for. \"Measured here\" is this repository's own numbers: the real model is SmolLM2-135M-Instruct on"
        " arithmetic word problems (held-out accuracy, one seed, sections above: the 10-step run of every trainer and"
        " `make demo`), the toy is `make demo-toy` (sampled reward after 40 steps). Costs are `make bench-smollm2`"
        f" ({real_suite['machine']['date']}, {real_suite['machine']['cores']} CPU cores, ratios to TRL's `GRPOTrainer`"
        " in the same run; on a GPU the critic's memory matters more than its time). Small runs on small models: they"
        " show direction and cost, not a ranking."
    )
    lines = [
        BEGIN,
        "",
        textwrap.fill(intro, WIDTH),
        "",
        "| pick | when | the paper's setting | measured here | cost vs GRPO (SmolLM2-135M) | watch |",
        "|---|---|---|---|---|---|",
    ]
    for name, when, paper, watch, measured in GUIDE:
        lines.append(f"| `{name}` | {when} | {paper} | {measured.format(**values)} | {_cost(name, real, toy)} | "
                     f"{watch.format(**values)} |")
    dapo = real.get("dapo")
    free = [real[n]["time_ratio"] for n in CRITIC_FREE if n in real]
    costs = (
        "Costs in one line: the critic-free trainers (RLOO, ReMax, REINFORCE++ and -baseline, TTRL) cost about what"
        " GRPO costs" + (f" ({min(free):.2f}-{max(free):.2f}x its step time)" if free else "")
        + "; PPO's full critic and VAPO's hold a second full model, the critic, with its optimizer state"
        + (f" ({_cost('ppo', real, toy)}; {_cost('vapo', real, toy)})" if "ppo" in real and "vapo" in real else "")
        + f"; PPO's default LoRA critic costs {values['ppo_lora_mem']} the memory of GRPO with a reference model"
        + f"; DAPO pays in generation: at a keep rate of {values['dapo_keep']} (the share of groups with a reward"
        " spread)" + (f" it needed {dapo['rounds_per_step']:.2f} rounds per step" if dapo else "")
        + ", fewer when the data suits the model."
    )
    lines += ["", textwrap.fill(costs, WIDTH), "", END]
    return "\n".join(lines)


def replace_guide(readme: str, guide: str) -> str:
    if BEGIN not in readme or END not in readme:
        raise ValueError(f"README.md has no guide markers ({BEGIN!r} ... {END!r})")
    return readme[: readme.index(BEGIN)] + guide + readme[readme.index(END) + len(END):]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="replace the guide in README.md")
    opts = parser.parse_args(argv)
    readme = README.read_text()
    guide = render(readme, json.loads(REAL_SUITE.read_text()), json.loads(TOY_SUITE.read_text()))
    if opts.write:
        README.write_text(replace_guide(readme, guide))
        print(f"guide written to {README}")
    else:
        print(guide)
    return 0


if __name__ == "__main__":
    sys.exit(main())
