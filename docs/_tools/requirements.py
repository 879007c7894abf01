"""Print the `docs` extra of pyproject.toml, one requirement a line, for `make docs` to install into its own
virtualenv without the package's runtime dependencies (torch, TRL): the site needs MkDocs and its plugins only.

    python docs/_tools/requirements.py    # standard library only, Python 3.10 too (no tomllib there)
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

PYPROJECT = Path(__file__).resolve().parents[2] / "pyproject.toml"


def docs_requirements(text: str) -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the extra is a one-level list of strings, read as Python
        match = re.search(r"^docs = (\[[\s\S]*?\])\s*$", text, flags=re.M)
        if match is None:
            raise SystemExit("pyproject.toml has no `docs` extra") from None
        return ast.literal_eval(match.group(1))
    return tomllib.loads(text)["project"]["optional-dependencies"]["docs"]


if __name__ == "__main__":
    print("\n".join(docs_requirements(PYPROJECT.read_text())))
