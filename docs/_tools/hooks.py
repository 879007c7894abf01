"""MkDocs hooks (mkdocs.yml `hooks:`): the derived parts of the site, built offline.

- the Algorithms section of the navigation: one page per docs page of `trl_ppo_variants.algorithms.REGISTRY`;
- each `<!-- generated: NAME -->` and `<!-- results: PATH -->` line of a page, expanded by `generate.expand`
  (algorithm table, headers and API directives, paper index, recipe table, bench/results files);
- the images of bench/results, served under `results/`;
- MathJax, served from the files of the `jupyter-server-mathjax` package (MathJax 2.7 with its STIX-Web fonts), so
  that the math renders without any network at build or reading time.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File

sys.path.insert(0, str(Path(__file__).resolve().parent))
import generate  # noqa: E402

#: the MathJax files the site needs (its TeX input, HTML-CSS output with the STIX-Web fonts, English messages)
MATHJAX_PARTS = ("MathJax.js", "config/", "extensions/", "jax/input/TeX/", "jax/output/HTML-CSS/", "jax/element/",
                 "fonts/HTML-CSS/STIX-Web/woff/", "localization/en/")
MATHJAX_SKIP = ("extensions/a11y/",)


def mathjax_dir() -> Path:
    spec = importlib.util.find_spec("jupyter_server_mathjax")  # finds the package without importing jupyter_server
    if spec is None or not spec.submodule_search_locations:
        raise PluginError("MathJax is missing: `pip install --no-deps jupyter-server-mathjax==0.2.6` "
                          "(`make docs` installs it)")
    return Path(next(iter(spec.submodule_search_locations))) / "static"


def on_config(config, **kwargs):
    for item in config["nav"] or []:
        if isinstance(item, dict) and "Algorithms" in item:
            section = item["Algorithms"]
            listed = {next(iter(p.values())) if isinstance(p, dict) else p for p in section}
            for page, entries in generate.pages().items():
                if page not in listed:
                    section.append({generate.page_title(entries): page})
    return config


def on_files(files, config, **kwargs):
    for path in sorted(generate.RESULTS.rglob("*.png")):
        files.append(File.generated(config, f"results/{path.relative_to(generate.RESULTS).as_posix()}",
                                    abs_src_path=str(path)))
    static = mathjax_dir()
    for path in sorted(static.rglob("*")):
        rel = path.relative_to(static).as_posix()
        if path.is_file() and rel.startswith(MATHJAX_PARTS) and not rel.startswith(MATHJAX_SKIP):
            files.append(File.generated(config, f"assets/mathjax/{rel}", abs_src_path=str(path)))
    return files


def on_page_markdown(markdown, page, config, files, **kwargs):
    try:
        return generate.expand(markdown, page.file.src_uri)
    except (ValueError, OSError, KeyError) as error:
        raise PluginError(f"{page.file.src_uri}: {error}") from error
