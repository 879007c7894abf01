"""What the docs and the README show that is derived, not typed: the algorithm table, the recipe table, the API
directives, the paper index, the included benchmark results.

    python docs/_tools/generate.py --write    # rewrite the generated regions of README.md and recipes/README.md
    python docs/_tools/generate.py --check    # exit 1 when one of them is stale (tests/test_readme.py checks too)

The docs pages get theirs at build time (`docs/_tools/hooks.py` replaces each `<!-- generated: NAME -->` line); the
two files read outside the site (README.md on the repository's front page, recipes/README.md installed with the
package) hold a region between `<!-- generated: NAME -->` and `<!-- /generated: NAME -->`, rewritten by `--write`.
Everything here reads `trl_ppo_variants.algorithms` (the one table of algorithms), the recipe files and
bench/results.
"""

from __future__ import annotations

import argparse
import posixpath
import re
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from a clone
    sys.path.insert(0, str(ROOT))

from trl_ppo_variants import algorithms  # noqa: E402  (imports nothing heavy)

DOCS = ROOT / "docs"
RESULTS = ROOT / "bench" / "results"
RECIPES = ROOT / "recipes"
README = ROOT / "README.md"
RECIPES_README = RECIPES / "README.md"
#: where the docs site is read from the repository (the README links its pages there)
DOCS_LINK = "docs"

MARKER = re.compile(r"^<!-- generated: (?P<name>[\w-]+)(?: (?P<arg>\S+))? -->$", re.M)


def _rel(target: str, page: str) -> str:
    """The link from the page `page` (a path relative to docs/) to the docs file `target`."""
    return posixpath.relpath(target, posixpath.dirname(page) or ".")


def pages() -> dict[str, list[algorithms.Algorithm]]:
    """docs page -> the entries it documents, in the registry's order (REINFORCE++ and -baseline share one)."""
    out: dict[str, list[algorithms.Algorithm]] = {}
    for entry in algorithms.REGISTRY.values():
        out.setdefault(entry.doc_page, []).append(entry)
    return out


def page_title(entries: list[algorithms.Algorithm]) -> str:
    return " / ".join(e.label for e in entries)


# ------------------------------------------------------------------------------------------------ tables
def algorithm_table(page: str, docs_prefix: str = "") -> str:
    """The algorithm table: name (a link to its page), paper, what it changes, config and trainer.

    `page` is where the table is shown (relative to docs/), for the links; `docs_prefix` is prepended to every link
    when the table is shown outside the site (the README: `docs/`)."""
    lines = ["| algorithm | paper | what it changes (with respect to GRPO) | config / trainer |", "|---|---|---|---|"]
    for entry in algorithms.REGISTRY.values():
        link = posixpath.join(docs_prefix, entry.doc_page) if docs_prefix else _rel(entry.doc_page, page)
        preset = "".join(f", `{k}={v!r}`" for k, v in entry.preset if v is not False)
        short = entry.paper.title.split(":")[0]  # "DeepSeekMath", "Back to Basics", ...
        lines.append(f"| [{entry.label}]({link}) | [{short}, arXiv {entry.paper.arxiv_id}]({entry.paper.url})"
                     f" | {entry.summary} | `{entry.config}`{preset} / `{entry.trainer}` |")
    return "\n".join(lines)


def paper_index(page: str) -> str:
    """Each algorithm's paper -> the settings that reproduce it (the code block under "Reproducing the paper" of its
    page, which that page owns)."""
    out = []
    for doc_page, entries in pages().items():
        text = (DOCS / doc_page).read_text()
        for entry in entries:
            out.append(f"### {entry.paper.title}\n")
            out.append(f"[arXiv {entry.paper.arxiv_id}]({entry.paper.url}) &middot; **{entry.label}** &middot; "
                       f"[its page]({_rel(doc_page, page)}) &middot; `trl-ppo-variants {entry.name}`\n")
            block = paper_settings(text, entry.name)
            if block:
                out.append(block + "\n")
    return "\n".join(out)


def paper_settings(text: str, name: str) -> str | None:
    """The fenced block after `<!-- paper-settings NAME -->` in a page's text."""
    match = re.search(rf"<!-- paper-settings {re.escape(name)} -->\s*\n(```[\s\S]*?\n```)", text)
    return match.group(1) if match else None


def algorithm_header(page: str) -> str:
    """The box at the top of an algorithm page: for each entry it documents, its paper, what it changes, its classes,
    its command and what it needs."""
    out = []
    for entry in pages()[page]:
        needs = [what for what, flag in (("a critic (value model)", entry.critic), ("no reward function: it makes its "
                 "own reward", entry.own_reward), ("step rewards", entry.step_rewards)) if flag]
        preset = "".join(f" with `{k}={v!r}`" for k, v in entry.preset if v is not False)
        out += [f'!!! abstract "{entry.label}"', "",
                f"    {entry.summary[0].upper()}{entry.summary[1:]}.", "",
                f"    - **Paper**: [{entry.paper.title}]({entry.paper.url}) (arXiv {entry.paper.arxiv_id})",
                f"    - **Classes**: `{entry.config}`{preset} and `{entry.trainer}`, "
                f"`from trl_ppo_variants import {entry.config}, {entry.trainer}`",
                f"    - **Command**: `trl-ppo-variants {entry.name} --config recipes/{entry.name}.yaml`"]
        if needs:
            out.append(f"    - **Needs**: {', '.join(needs)}")
        out.append("")
    return "\n".join(out).rstrip()


def algorithm_api(page: str) -> str:
    """mkdocstrings directives for the config and trainer classes a page documents (each rendered once)."""
    seen, out = set(), []
    for entry in pages()[page]:
        for name in (entry.config, entry.trainer):
            path = f"{entry.module_path}.{name}"
            if path not in seen:
                seen.add(path)
                out.append(f"::: {path}\n")
    return "\n".join(out)


def api_index(page: str) -> str:
    lines = ["| algorithm | config | trainer |", "|---|---|---|"]
    for entry in algorithms.REGISTRY.values():
        link = _rel(entry.doc_page, page)
        lines.append(f"| [{entry.label}]({link}) | [`{entry.config}`][{entry.module_path}.{entry.config}] | "
                     f"[`{entry.trainer}`][{entry.module_path}.{entry.trainer}] |")
    return "\n".join(lines)


def recipe_table() -> str:
    """One row per algorithm recipe (`recipes/<name>.yaml`): its paper, data, samples per prompt and length."""
    lines = ["| recipe | algorithm | data | samples / prompt | `max_completion_length` |", "|---|---|---|---|---|"]
    for entry in algorithms.ALGORITHMS.values():
        path = RECIPES / f"{entry.name}.yaml"
        if not path.exists():
            continue
        recipe = yaml.safe_load(path.read_text())
        data = recipe["dataset_name"] + (", no labels" if entry.own_reward else "")
        if "n_votes" in recipe:
            samples = f"{recipe['n_votes']} votes, {recipe['n_train']} trained"
        else:
            samples = str(recipe["num_generations"])
            if entry.trainer == "ReMaxTrainer":  # its baseline is one greedy completion more per prompt
                samples += " (+ 1 greedy)"
        paper = f"{entry.label} (arXiv {entry.paper.arxiv_id})"
        if recipe.get("process_reward_model_path"):
            paper += f", PRM `{recipe['process_reward_model_path']}`"
        lines.append(f"| `{entry.name}.yaml` | {paper} | {data} | {samples} | {recipe['max_completion_length']} |")
    return "\n".join(lines)


LOGGING = DOCS / "how-to" / "logging.md"


def customisation(page: str) -> str:
    """The worked customisation of an algorithm page, as TRL's trainer pages show it: a reward function of one's own,
    generation with vLLM (colocate, server) and several nodes under SLURM, with the page's own classes. The details
    live on the how-to pages, linked."""
    entry = pages()[page][0]
    preset = "".join(f", {k}={v!r}" for k, v in entry.preset if v is not False)
    link = lambda target: _rel(target, page)  # noqa: E731
    out = ["### A reward function of your own", ""]
    if entry.own_reward:
        out += [f"{entry.label} makes its own reward (the majority vote of each prompt's samples): it takes no "
                "reward function, and refuses one that reads the ground truth. What it needs is an answer extractor "
                f"([Command line and recipes]({link('how-to/cli.md')}#your-own-data-and-rewards)).", ""]
    else:
        out += ["A reward function takes the completions and the dataset's columns as keyword arguments and returns "
                "one float per completion (`None` for a completion it cannot score), as for `trl.GRPOTrainer`:", "",
                "```python",
                f"from trl_ppo_variants import {entry.config}, {entry.trainer}",
                "",
                "",
                "def ends_with_answer(completions, answer, **kwargs):  # `answer` is a column of the dataset",
                "    return [float(c.strip().endswith(a)) for c, a in zip(completions, answer)]",
                "",
                "",
                f"trainer = {entry.trainer}(model=\"Qwen/Qwen3-0.6B\", reward_funcs=[ends_with_answer],",
                f"    args={entry.config}(output_dir=\"out\"{preset}), train_dataset=dataset)",
                "```", ""]
        if entry.step_rewards:
            out += ["Step rewards come through `step_reward_funcs` or a process reward model "
                    f"([Process supervision]({link('concepts/process-supervision.md')})).", ""]
    out += ["### Generation with vLLM", "",
            f"`{entry.config}(use_vllm=True, vllm_mode=\"colocate\")` runs the engine inside the training processes; "
            "`vllm_mode=\"server\"` sends generation to a `trl vllm-serve` process on GPUs of its own. Both as for "
            f"`trl.GRPOTrainer`; what this trainer sends through the engine: [vLLM]({link('how-to/vllm.md')}).", "",
            "### Several nodes under SLURM", "",
            f"`accelerate launch` on every node, with a config of `recipes/accelerate/` and the node's rank, runs "
            f"`trl-ppo-variants {entry.name} --config recipes/{entry.name}.yaml`; under SLURM one task per node starts "
            f"it: [Distributed training]({link('how-to/distributed.md')}#several-nodes).", ""]
    return "\n".join(out).rstrip()


def _cells(row: str) -> list[str]:
    """The cells of a Markdown table row (`\\|` inside a cell is text)."""
    return [cell.strip() for cell in re.split(r"(?<!\\)\|", row.strip())[1:-1]]


def logged_metrics(prefixes: str, page: str) -> str:
    """The rows of the Logging page's metric table whose metrics start with one of `prefixes` (comma-separated): an
    algorithm page shows what its trainer logs with the meanings written once, on the Logging page."""
    wanted = prefixes.split(",")
    rows = [line for line in LOGGING.read_text().splitlines() if line.startswith("| `")]
    out, used = ["| metric | logged by | what it means |", "|---|---|---|"], set()
    for row in rows:
        metric, logged_by, meaning = _cells(row)
        names = re.findall(r"`([^`]+)`", metric)
        hits = {p for p in wanted for name in names if name.startswith(p)}
        if hits:
            used |= hits
            out.append(f"| {metric} | {logged_by} | {meaning} |")
    if used != set(wanted):
        raise ValueError(f"no metric of {LOGGING.relative_to(ROOT)} starts with {sorted(set(wanted) - used)}")
    link = _rel("how-to/logging.md", page)
    return "\n".join(out) + f"\n\nTRL's own metrics (`reward`, `reward_std`, `entropy`, `completions/...`, `clip_ratio/...`) are logged as well: [Logging]({link})."


# ------------------------------------------------------------------------------------------------ results
#: a results file shown in a page; an indented marker (inside a `??? note` admonition, to fold a long table) indents
#: what it shows as much
RESULT_MARKER = re.compile(r"^(?P<indent>[ \t]*)<!-- results: (?P<path>\S+) -->$", re.M)


def result_block(path: str) -> str:
    """A results file of bench/results shown in a page: its Markdown with its headings made subordinate, `<` outside
    code escaped, and a blank line before each list that follows a line of text (the scripts write them without;
    Markdown needs it)."""
    text = (RESULTS / path).read_text().strip()
    text = re.sub(r"^(#{1,4}) ", lambda m: "#" * min(len(m[1]) + 3, 6) + " ", text, flags=re.M)
    # a `<` outside code is text, not HTML (pytest's `<locals>` would vanish as a tag)
    text = "`".join(part.replace("<", "&lt;") if i % 2 == 0 else part for i, part in enumerate(text.split("`")))
    return re.sub(r"^((?!- |\s*$).+)\n(?=- )", r"\1\n\n", text, flags=re.M)


def included_results() -> set[str]:
    """The bench/results files some docs page includes."""
    found = set()
    for page in DOCS.rglob("*.md"):
        found |= {match["path"] for match in RESULT_MARKER.finditer(page.read_text())}
    return found


# ------------------------------------------------------------------------------------------------ expansion
def expand(text: str, page: str) -> str:
    """A docs page's Markdown with every generated marker replaced (the build hook calls this)."""

    def generated(match: re.Match) -> str:
        name, arg = match["name"], match["arg"]
        if name == "algorithms":
            return algorithm_table(page)
        if name == "algorithm-header":
            return algorithm_header(page)
        if name == "algorithm-api":
            return algorithm_api(page)
        if name == "api-index":
            return api_index(page)
        if name == "paper-index":
            return paper_index(page)
        if name == "recipes":
            return recipe_table()
        if name == "customisation":
            return customisation(page)
        if name == "metrics":
            return logged_metrics(arg, page)
        raise ValueError(f"{page}: unknown generated block {name!r}")

    text = MARKER.sub(generated, text)
    def results(match: re.Match) -> str:
        block = result_block(match["path"])
        if match["indent"]:  # folded: its headings become bold lines, so the table of contents stays the page's own
            block = re.sub(r"^#{1,6} (.+)$", r"**\1**", block, flags=re.M)
        return "\n".join(match["indent"] + line if line else line for line in block.split("\n"))

    return RESULT_MARKER.sub(results, text)


#: file -> generated regions it holds, and how each is written there
REGIONS = {
    README: {"algorithms": lambda: algorithm_table("index.md", docs_prefix=DOCS_LINK)},
    RECIPES_README: {"recipes": recipe_table},
}


def region(name: str, body: str) -> str:
    return f"<!-- generated: {name} -->\n{body}\n<!-- /generated: {name} -->"


def rewrite(text: str, regions: dict) -> str:
    for name, make in regions.items():
        pattern = re.compile(rf"<!-- generated: {name} -->\n[\s\S]*?<!-- /generated: {name} -->")
        if not pattern.search(text):
            raise ValueError(f"no generated region {name!r}")
        text = pattern.sub(lambda _: region(name, make()), text)
    return text


def stale() -> list[Path]:
    return [path for path, regions in REGIONS.items() if rewrite(path.read_text(), regions) != path.read_text()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the generated regions")
    parser.add_argument("--check", action="store_true", help="exit 1 when a generated region is stale")
    opts = parser.parse_args(argv)
    if opts.write:
        for path, regions in REGIONS.items():
            path.write_text(rewrite(path.read_text(), regions))
            print(f"wrote {path.relative_to(ROOT)}")
        return 0
    if opts.check:
        bad = stale()
        for path in bad:
            print(f"{path.relative_to(ROOT)} is stale: run `python docs/_tools/generate.py --write`")
        return 1 if bad else 0
    print(algorithm_table("index.md", docs_prefix=DOCS_LINK))
    return 0


if __name__ == "__main__":
    sys.exit(main())
