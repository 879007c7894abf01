"""A griffe extension that reads the package's docstrings, written in TRL's (Hugging Face doc-builder's) format, as the
Google style that mkdocstrings renders, without changing the docstrings themselves.

TRL's format, which the configs keep so that they read like `trl.GRPOConfig`'s::

    Parameters:
        epsilon_high (`float`, *optional*, defaults to `0.28`):
            Upper clip range (Clip-Higher: decoupled from `epsilon`).

becomes ``epsilon_high (float): Upper clip range (...). Defaults to `0.28`.``, and doc-builder's cross-references
(`` [`~trl.GRPOConfig`] ``, `` [`DAPOTrainer`] ``) become links to the rendered object when it is in these docs
(mkdocs-autorefs' optional references: no link, no warning, when it is not) or code for TRL's objects.
"""

from __future__ import annotations

import re

import griffe

from trl_ppo_variants import algorithms

#: `name (`type`, *optional*, defaults to `value`):` and its variants (no default, no *optional*)
_ITEM = re.compile(r"^(?P<indent>\s+)(?P<name>\*{0,2}\w+) \((?P<spec>[^()]*(?:\([^()]*\)[^()]*)*)\):\s*(?P<rest>.*)$")
_DEFAULT = re.compile(r",?\s*(?:\*optional\*,?\s*)?defaults to (?P<value>.+)$")
_XREF = re.compile(r"\[`(?P<tilde>~?)(?P<target>[\w.]+)`\]")
_LIST_ITEM = re.compile(r"^\s*(?:- |\d+\. )")
_SECTIONS = ("Parameters:", "Args:", "Arguments:", "Attributes:")


def _public_paths() -> dict[str, str]:
    """Public class name -> its defining module's dotted path (the package's lazy exports)."""
    return {name: f"{algorithms.PACKAGE}.{module}.{name}" for name, module in algorithms.exports().items()}


def _xref(match: re.Match, module: str, public: dict[str, str]) -> str:
    target = match["target"]
    shown = target.rsplit(".", 1)[-1] if match["tilde"] else target
    if not target.startswith(algorithms.PACKAGE) and "." in target:  # TRL's, transformers'...: not in these docs
        return f"`{target}`"
    if "." not in target:
        target = public.get(target, f"{module}.{target}")
    elif target.count(".") == 1 and target.rsplit(".", 1)[-1] in public:  # `trl_ppo_variants.VariantConfig`
        target = public[target.rsplit(".", 1)[-1]]
    return f'<autoref identifier="{target}" optional><code>{shown}</code></autoref>'


def convert(text: str, module: str, signature: frozenset = frozenset()) -> str:
    """The docstring `text` (of an object of `module`) in Google style, with cross-references resolved. A field's
    default is written into its description unless it is a parameter in `signature` (mkdocstrings shows those)."""
    public = _public_paths()
    lines = text.splitlines()
    out: list[str] = []
    section_indent = None  # indentation of the current Parameters-like section header, if in one
    pending_default = None  # (index in out of the item's last line, default) of the open item
    item_indent = None

    def close_item():
        nonlocal pending_default
        if pending_default is not None:
            index, value = pending_default
            out[index] = out[index].rstrip() + f" Defaults to {value}."
            pending_default = None

    for line in lines:
        stripped = line.strip()
        indent = len(line) - len(line.lstrip())
        if stripped in _SECTIONS:
            close_item()
            section_indent, item_indent = indent, None
            out.append(line)
            continue
        if section_indent is not None and stripped and indent <= section_indent:
            close_item()
            section_indent = None  # the section ended
        if section_indent is not None:
            match = _ITEM.match(line)
            if match and (item_indent is None or len(match["indent"]) == item_indent):
                close_item()
                item_indent = len(match["indent"])
                spec = match["spec"]
                default = _DEFAULT.search(spec)
                spec = _DEFAULT.sub("", spec) if default else spec
                spec = spec.replace("*optional*", "").strip().rstrip(",").strip()
                spec = spec.replace("`", "")
                out.append(f"{match['indent']}{match['name']} ({spec}): {match['rest']}".rstrip())
                if default and match["name"] not in signature:
                    pending_default = (len(out) - 1, default["value"].strip())
                continue
            out.append(line)
            if stripped and pending_default is not None:
                pending_default = (len(out) - 1, pending_default[1])
            continue
        if _LIST_ITEM.match(line) and out and out[-1].strip() and not _LIST_ITEM.match(out[-1]) \
                and len(out[-1]) - len(out[-1].lstrip()) <= indent:
            out.append("")  # Markdown starts a list only after a blank line; docstrings often omit it
        out.append(line)
    close_item()
    return "\n".join(_XREF.sub(lambda m: _xref(m, module, public), line) for line in out)


class HFDocstrings(griffe.Extension):
    """Rewrite each docstring of the package before mkdocstrings parses it."""

    def on_instance(self, *, obj: griffe.Object, **kwargs) -> None:
        if obj.is_class:  # after its members are known: `on_class_members`
            return
        self._convert(obj, frozenset())

    def on_class_members(self, *, cls: griffe.Class, **kwargs) -> None:
        # a dataclass field defined in the class body is a parameter of its generated __init__: shown with its default
        self._convert(cls, frozenset(name for name, member in cls.members.items() if member.is_attribute))

    @staticmethod
    def _convert(obj: griffe.Object, signature: frozenset) -> None:
        if obj.docstring is None or not obj.path.startswith(algorithms.PACKAGE):
            return
        module = obj.module.path if not obj.is_module else obj.path
        obj.docstring.value = convert(obj.docstring.value, module, signature)
