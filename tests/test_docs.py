"""The docs site (docs/, mkdocs.yml) must follow the code and the measurements: it builds strictly and offline; the
"Which algorithm should I use?" guide is `bench/guide.py`'s output from the measured numbers; every metric the package
logs is in the Logging table; every result table of bench/results is shown; every code block is valid against the
code; every algorithm page holds the settings that reproduce its paper; the configs' TRL-style docstrings render."""

import copy
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import doc_blocks
import pytest

from trl_ppo_variants import algorithms

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


guide = _load("guide", ROOT / "bench" / "guide.py")
generate = _load("generate", DOCS / "_tools" / "generate.py")


def _suites():
    return json.loads(guide.REAL_SUITE.read_text()), json.loads(guide.TOY_SUITE.read_text())


def _squash(text: str) -> str:
    return " ".join(text.split())


# ------------------------------------------------------------------------------------------------ the build
@pytest.mark.timeout(300)
def test_docs_build_strictly_and_offline(tmp_path):
    """`mkdocs build --strict` (what `make docs` runs): a broken link, anchor, include, page or reference fails it.
    No network: the math is served from the site (MathJax), no web font is fetched."""
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1", "PYTHONPATH": str(ROOT)}
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=280)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for entry in algorithms.REGISTRY.values():  # one page per algorithm, its API rendered there
        page = (site / entry.doc_page.replace(".md", ".html")).read_text()
        assert f'id="{entry.module_path}.{entry.config}"' in page and entry.paper.arxiv_id in page, entry.name
    home = (site / "index.html").read_text()
    assert "fonts.googleapis" not in home and "assets/mathjax/MathJax.js" in home
    assert (site / "assets" / "mathjax" / "MathJax.js").exists()
    assert (site / "assets" / "mathjax" / "config" / "TeX-AMS-MML_HTMLorMML-full.js").exists()
    dapo = (site / "algorithms" / "dapo.html").read_text()
    assert 'class="arithmatex"' in dapo and "L_{\\text{cache}}" in dapo
    _check_api_pages(site)


def _api_text(page: str) -> str:
    """The text of the mkdocstrings objects of a built page (signatures and docstrings)."""
    import html

    return "\n".join(html.unescape(re.sub(r"<[^>]+>", "", m[0])) for m in re.finditer(
        r'<div class="doc doc-object[\s\S]*?(?=<div class="doc doc-object|</article>)', page))


def _check_api_pages(site: Path) -> None:
    """The API as users read it: docstrings without issue numbers, private names or raw docs paths; signatures one
    parameter a line when Ruff (the `docs` extra) is there to format them."""
    pages = sorted((site / "algorithms").glob("*.html")) + sorted((site / "api").glob("*.html"))
    for path in pages:
        text = _api_text(path.read_text())
        for pattern in (r"[Ii]ssue \d+", r"\bdocs/[\w/-]+\.md", r"(?<![\w.~])_[a-z]{2,}\w*"):
            found = re.search(pattern, text)
            assert found is None, f"{path.name}: {found[0]!r} in a public docstring"
    if importlib.util.find_spec("ruff") is not None:  # mkdocstrings formats signatures with it
        dapo = (site / "algorithms" / "dapo.html").read_text()
        signature = re.search(r'<div class="doc-signature[\s\S]*?</pre>', dapo[dapo.index('id="trl_ppo_variants.trainers.dapo.DAPOConfig"'):])
        lines = re.sub(r"<[^>]+>", "", signature[0]).splitlines()
        assert len(lines) > 10 and max(map(len, lines)) <= 100, lines[:3]


# ------------------------------------------------------------------------------------------------ the guide
def test_guide_is_the_generated_one():
    expected = guide.render(guide.DEMO_PAGE.read_text(), *_suites(), tta=guide.load_tta())
    assert expected in guide.GUIDE_PAGE.read_text(), "docs/guide.md is stale: run `python bench/guide.py --write`"


def test_numbers_stated_in_prose_are_the_docs():
    """Each number the guide takes from the docs' prose is there, outside the guide (reflowed lines allowed)."""
    text = _squash(guide.prose_pages())
    for name, (quoted, shown) in guide.PROSE_NUMBERS.items():
        assert _squash(quoted) in text, (name, quoted)
        for number in re.findall(r"\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)?", shown):  # what the guide shows is quoted
            assert number in quoted, (name, number, quoted)


def test_every_command_has_a_guide_row_and_every_measurement_is_read():
    assert [name for name, _ in guide.guide_rows()] == list(algorithms.REGISTRY)
    page = guide.DEMO_PAGE.read_text()
    toy = guide.toy_results(page)
    assert set(toy) == set(algorithms.ALGORITHMS) and all(0 <= b <= 1 and 0 <= a <= 1 for b, a in toy.values())
    demo = guide.demo_results(page)
    assert algorithms.BASELINE.name in demo and len(demo) >= 2
    for before, after, gain in demo.values():
        assert abs(after - before - gain) < 1.5e-3


def test_the_guide_follows_the_numbers():
    """Change a benchmark number, a demo result or a page's guide row and the guide says the new one."""
    page = guide.DEMO_PAGE.read_text()
    real, toy = _suites()
    changed = copy.deepcopy(real)
    critic = next(a for a in algorithms.ALGORITHMS.values() if a.critic)
    row = next(r for r in changed["results"] if r["name"] == critic.name)
    row["time_ratio"] = 2.345
    memory = {**guide.critic_memory(), critic.name: (1.987, "with a reference model")}  # the critics' memory runs
    text = guide.render(page, changed, toy, memory=memory)
    shown = "2.35x time, 1.99x the memory of GRPO with a reference model"
    assert shown in text and shown not in guide.render(page, real, toy)
    name = next(n for n in guide.toy_results(page) if n != critic.name)
    rewritten = re.sub(rf"^{name}(\s+)0\.47 -> [\d.]+", rf"{name}\g<1>0.47 -> 0.99", page, flags=re.M)
    assert guide.toy_results(rewritten)[name] == (0.47, 0.99)
    rows = [(n, {**r, "watch": "a new caveat"} if n == name else r) for n, r in guide.guide_rows()]
    assert "a new caveat" in guide.render(page, real, toy, rows)


# ------------------------------------------------------------------------------------------------ logged metrics
#: metrics logged under a computed name, and how the Logging table names them
DYNAMIC_METRICS = {"ttrl/{prefix}/{name}": "ttrl/votes/", "rewards/{name}/non_finite": "rewards/<function>/non_finite"}
#: TRL's own metrics that a trainer of this package logs a value of (not additions: the prose names them)
TRL_METRICS = {"frac_reward_zero_std"}
LOGGING = DOCS / "how-to" / "logging.md"


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


def test_every_logged_metric_is_in_the_logging_table():
    """The Logging page's table names every metric a trainer of this package adds (a new metric gets a row)."""
    page = LOGGING.read_text()
    documented = set(re.findall(r"`([^`]+)`", "\n".join(l for l in page.splitlines() if l.startswith("| `"))))
    names = _logged_metric_names()
    assert {"selection/rounds", "selection/greso_p_easy", "value/explained_variance", "remax/greedy_reward",
            "critic_warmup"} <= names  # the scan
    for name in names:
        if name in TRL_METRICS:  # TRL's own metric, restated by a trainer (SPEED's rounds): named in the prose
            assert f"`{name}`" in page, name
        elif name in DYNAMIC_METRICS:
            assert any(d.startswith(DYNAMIC_METRICS[name]) for d in documented), name
        else:
            assert name in documented, f"metric {name!r} is logged but not in docs/how-to/logging.md"
    from trl_ppo_variants.rewards import vote_statistics

    for stat in [*vote_statistics([1.0, 0.0], 2, [1.0, 0.0], [True]), "no_answer_frac"]:
        assert any(f"ttrl/votes/{stat}" in d for d in documented), stat


# ------------------------------------------------------------------------------------------------ pages
def test_docs_code_blocks_are_valid():
    pages = sorted(DOCS.rglob("*.md"))
    assert sum(len(doc_blocks.blocks(p.read_text(), "python")) for p in pages) >= 20
    problems = [problem for page in pages for problem in doc_blocks.problems_of(page)]
    assert problems == []


def test_every_result_table_is_shown():
    """Each Markdown result file of bench/results is shown by a docs page (`<!-- results: PATH -->`), so a new one
    joins the benchmarks page with one line, and none is silently left out."""
    results = {p.relative_to(generate.RESULTS).as_posix() for p in generate.RESULTS.rglob("*.md")}
    shown = generate.included_results()
    assert results - shown == set(), f"result tables shown by no docs page: {sorted(results - shown)}"
    assert shown - results == set(), f"docs pages show missing result files: {sorted(shown - results)}"


def test_every_algorithm_page_reproduces_its_paper():
    """Each registry entry's page holds a `<!-- paper-settings NAME -->` block (the paper index shows it), a config
    call whose fields are the config's (tests/doc_blocks.py), and the generated header and API."""
    for page, entries in generate.pages().items():
        text = (DOCS / page).read_text()
        assert "<!-- generated: algorithm-header -->" in text and "<!-- generated: algorithm-api -->" in text, page
        for entry in entries:
            block = generate.paper_settings(text, entry.name)
            assert block is not None, f"docs/{page}: no paper-settings block for {entry.name}"
            code = block.split("\n", 1)[1].rsplit("```", 1)[0]
            assert f"{entry.config}(" in code and doc_blocks.python_problems(code) == [], (entry.name, code)
    index = generate.paper_index("papers.md")
    assert all(entry.paper.arxiv_id in index for entry in algorithms.REGISTRY.values())


# ------------------------------------------------------------------------------------------------ the API reference
def test_trl_style_docstrings_render_as_google_style():
    """The configs keep TRL's docstring format; the griffe extension turns it into what mkdocstrings parses: every
    field a parameter with its type and description, the default said where the signature does not show it, and
    doc-builder's cross-references made links (this package) or code (TRL)."""
    import griffe

    hf = _load("griffe_hf", DOCS / "_tools" / "griffe_hf.py")
    text = """
    Configuration for [`DAPOTrainer`]: [`~trl.GRPOConfig`] with [`~trl_ppo_variants.VariantConfig`].

    Parameters:
        epsilon_high (`float` or `None`, *optional*, defaults to `0.28`):
            Upper clip range
            (Clip-Higher).
        beta (`float`, *optional*, defaults to `0.0`):
            KL loss coefficient.
        overlong_cache_length (`int`, *optional*):
            `L_cache`.
    """
    converted = hf.convert(text, "trl_ppo_variants.trainers.dapo", frozenset({"beta"}))
    assert "`trl.GRPOConfig`" in converted and "[`" not in converted
    assert 'identifier="trl_ppo_variants.trainers.dapo.DAPOTrainer"' in converted
    assert 'identifier="trl_ppo_variants.trainers.base.VariantConfig"' in converted
    docstring = griffe.Docstring(converted, lineno=1)
    sections = docstring.parse("google", warnings=False)
    params = {p.name: p for s in sections if s.kind.value == "parameters" for p in s.value}
    assert list(params) == ["epsilon_high", "beta", "overlong_cache_length"]
    assert str(params["epsilon_high"].annotation) == "float or None"
    assert params["epsilon_high"].description.strip() == "Upper clip range\n(Clip-Higher). Defaults to `0.28`."
    assert params["beta"].description.strip() == "KL loss coefficient."  # in the signature: mkdocstrings shows the default
    assert params["overlong_cache_length"].description.strip() == "`L_cache`."


def test_the_guide_states_the_multi_seed_time_to_accuracy():
    report = {"protocol": {"grpo_steps": 12}, "methods": ["grpo", "dapo", "dapo_nopen"],
              "labels": {"grpo": "trl.GRPOTrainer", "dapo": "DAPO", "dapo_nopen": "DAPO [overlong_penalty=False]"},
              "summary": {
        "grpo": {"seeds": 5, "acc_at_budget": 0.4, "reached_by_half": 1, "time_ratio_median": 0.8},
        "dapo": {"seeds": 5, "acc_at_budget": 0.6, "reached_by_half": 4, "time_ratio_median": 0.31},
        "dapo_nopen": {"seeds": 2, "acc_at_budget": 0.5, "reached_by_half": 2, "time_ratio_median": 0.2}}}
    text = guide.tta_sentence(report)
    assert text.startswith("Time to accuracy over 5 seeds")
    assert "ends its 12 steps at a mean held-out accuracy of 0.400" in text
    assert "DAPO reached it by half that time on 4 of 5 seeds (median 0.31x) and ended at 0.600" in text
    assert "overlong_penalty" not in text  # a variant run on 2 of the 5 seeds stays on the benchmarks page


def test_paper_settings_said_to_be_a_recipe_are_the_recipe():
    """A page that says its "Reproducing the paper" block is the shipped recipe shows the recipe's values: every field of
    the block is the recipe's (PPO's page: the paper's clip, GAE and value loss with verl's GSM8K KL and critic rate)."""
    import ast

    import yaml

    checked = 0
    for page, entries in generate.pages().items():
        text = (DOCS / page).read_text()
        for entry in entries:
            marker = f"<!-- paper-settings {entry.name} -->"
            if marker not in text:
                continue
            before = text[: text.index(marker)].rsplit("\n\n", 2)[-2:]
            recipe_path = f"recipes/{entry.name}.yaml"
            if not any(f"`{recipe_path}`" in part for part in before):
                continue
            block = generate.paper_settings(text, entry.name).split("\n", 1)[1].rsplit("```", 1)[0]
            call = ast.parse(block).body[0].value
            recipe = yaml.safe_load((ROOT / recipe_path).read_text())
            for keyword in call.keywords:
                assert keyword.arg in recipe, (page, keyword.arg)
                assert ast.literal_eval(keyword.value) == recipe[keyword.arg], (page, keyword.arg, recipe[keyword.arg])
            checked += 1
    assert checked >= 1


def test_the_docs_build_imports_nothing_heavy():
    """`make docs` builds in a virtualenv without torch or TRL (docs/_tools/requirements.py installs the `docs` extra
    alone): the build's hooks, its griffe extension and what they import must not need them."""
    code = ("import sys; sys.path.insert(0, 'docs/_tools'); import hooks, griffe_hf, generate, requirements; "
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'trl', 'transformers', 'deepspeed', "
            "'accelerate', 'datasets', 'numpy'}); print(','.join(heavy))")
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip() == "", f"the docs build imports {run.stdout.strip()}"
    requirements = _load("requirements", DOCS / "_tools" / "requirements.py")
    extra = requirements.docs_requirements((ROOT / "pyproject.toml").read_text())
    assert any(r.startswith("mkdocs") for r in extra) and not any(r.split("[")[0].split(">")[0].split("=")[0] in (
        "torch", "trl", "transformers") for r in extra)


def test_every_algorithm_page_shows_its_customisation_and_metrics():
    """Each algorithm page shows its own reward function, vLLM and SLURM (generated with its classes: the code is valid
    against them) and the metrics its trainer logs, their meanings taken from the Logging page's table."""
    for page, entries in generate.pages().items():
        text = (DOCS / page).read_text()
        assert "<!-- generated: customisation -->" in text and "<!-- generated: metrics " in text, page
        shown = generate.customisation(page)
        for code in doc_blocks.blocks(shown, "python"):
            assert doc_blocks.python_problems(code) == [], (page, code)
        prefixes = re.search(r"<!-- generated: metrics (\S+) -->", text)[1]
        table = generate.logged_metrics(prefixes, page)
        assert table.count("\n| `") >= len(prefixes.split(",")) - 1, page
    with pytest.raises(ValueError, match="starts with"):
        generate.logged_metrics("value/,no_such_metric/", "algorithms/ppo.md")


def test_a_folded_result_table_is_indented_and_leaves_the_table_of_contents():
    """`<!-- results: PATH -->` indented under `??? note` shows the file inside the fold: every line indented as the
    marker, its headings bold lines (the page's table of contents stays its own); unindented, the file as it is."""
    path = "smollm2/time_to_accuracy_2026-12-06/time_to_accuracy_steps.md"
    folded = generate.expand(f'??? note "logs"\n\n    <!-- results: {path} -->\n', "benchmarks/x.md")
    body = folded.split("\n", 2)[2]
    assert all(line.startswith("    ") for line in body.splitlines() if line)
    assert not re.search(r"^\s*#", body, flags=re.M) and "**" in body
    plain = generate.expand(f"<!-- results: {path} -->\n", "benchmarks/x.md")
    assert re.search(r"^#+ ", plain, flags=re.M)
