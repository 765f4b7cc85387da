"""MkDocs hooks: shape notes in docstrings are not cross-references; the module table of
`reference/layout.md` is made from the modules' docstrings at build time.

Docstrings write shapes as `[G][T_i]` or `[N][len(target)]`, which autorefs reads as
`[title][identifier]` references and reports as missing targets, failing the strict build.
This drops exactly those reports: ones raised from a Python docstring whose target is not a
dotted Python path (`lit_grpo.x.y`). Any other missing reference, in a page or a docstring,
still fails `mkdocs build --strict`.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

_DOCSTRING_REF = re.compile(r"from \S+\.py:\d+: .*Could not find cross-reference target '(?P<ref>[^']*)'")
_DOTTED_PATH = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")


class _ShapeNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        match = _DOCSTRING_REF.search(record.getMessage())
        return not (match and not _DOTTED_PATH.match(match["ref"]))


_FILTER = _ShapeNotes()


def on_pre_build(config, **kwargs) -> None:
    # The strict-mode counter is a handler on the `mkdocs` logger, added as each build starts.
    for handler in logging.getLogger("mkdocs").handlers:
        handler.addFilter(_FILTER)


_MODULE_TABLE = "<!-- module-table -->"


def _summary(docstring: str) -> str:
    """The first sentence of a module docstring, on one line, short enough for a table cell."""
    first = " ".join(docstring.split("\n\n")[0].split())
    match = re.match(r"(.+?\.)(\s|$)", first)
    text = (match.group(1) if match else first).rstrip(".")
    if len(text) > 160:
        text = text[:157].rsplit(" ", 1)[0]
        if text.count("`") % 2:
            text = text.rsplit("`", 1)[0].rstrip()
        text = text.rstrip(",;:( ") + " ..."
    return text.replace("|", "\\|")


def module_table(package: Path) -> str:
    """One Markdown table row per module of `package` (its `__init__.py` files left out)."""
    rows = ["| module | what it holds |", "|---|---|"]
    for path in sorted(package.rglob("*.py")):
        if path.name == "__init__.py" or "__pycache__" in path.parts:
            continue
        docstring = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""
        rows.append(f"| `{path.relative_to(package.parent).as_posix()}` | {_summary(docstring)} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, **kwargs) -> str:
    if _MODULE_TABLE in markdown:
        root = Path(config.config_file_path).parent
        markdown = markdown.replace(_MODULE_TABLE, module_table(root / "lit_grpo"))
    return markdown
