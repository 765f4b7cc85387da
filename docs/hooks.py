"""MkDocs hooks: shape notes in docstrings are not cross-references; the tables that restate the
code are made from it at build time, each where its marker line stands in a page: the module table
(`<!-- module-table -->`, from the modules' docstrings), the `make` targets (`<!-- make-targets -->`,
from the Makefile's `## ` comments), the config fields with their defaults
(`<!-- config-fields top|groups -->`, from the dataclasses and the default composed config) and
the config keys that moved (`<!-- moved-keys -->`, from `lit_grpo.config.moved.MOVED`).
docs/development.md lists what is made and what `tests/test_docs_*.py` check.

Docstrings write shapes as `[G][T_i]` or `[N][len(target)]`, which autorefs reads as
`[title][identifier]` references and reports as missing targets, failing the strict build.
This drops exactly those reports: ones raised from a Python docstring whose target is not a
dotted Python path (`lit_grpo.x.y`). Any other missing reference, in a page or a docstring,
still fails `mkdocs build --strict`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import logging
import re
import textwrap
import typing
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


# Each marker is a line of its own, so a page can name one in code without it being filled in.
_MODULE_TABLE = re.compile(r"^<!-- module-table -->$", re.M)


# A full stop that ends a sentence: not one of an ellipsis, `e.g.` or `i.e.`, and followed by a space or the end.
_SENTENCE_END = re.compile(r"(?<!\be\.g)(?<!\bi\.e)(?<!\.)\.(?!\.)(?=\s|$)")


def _summary(docstring: str) -> str:
    """The first sentence of a docstring, on one line, short enough for a table cell."""
    first = " ".join(docstring.split("\n\n")[0].split())
    match = _SENTENCE_END.search(first)
    text = first[: match.start()] if match else first
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


_MAKE_TARGETS = re.compile(r"^<!-- make-targets(?: (?P<prefix>[\w-]+))? -->$", re.M)
_HELP_LINE = re.compile(r"^(?P<target>[a-zA-Z0-9_-]+):.*## (?P<help>.+)$")  # the pattern of the Makefile's own `help`


def make_targets(makefile: Path) -> dict[str, str]:
    """The Makefile's documented targets, `target -> help text`, in the Makefile's order: those
    with a `## ` comment, exactly the ones `make help` lists."""
    lines = makefile.read_text(encoding="utf-8").splitlines()
    return {m["target"]: m["help"].strip() for m in map(_HELP_LINE.match, lines) if m}


def make_table(makefile: Path, prefix: str = "") -> str:
    """A Markdown table of the documented targets whose name starts with `prefix`."""
    rows = ["| target | what it does |", "|---|---|"]
    for target, text in make_targets(makefile).items():
        if target.startswith(prefix):
            rows.append(f"| `make {target}` | {_cell(text)} |")
    return "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


_CONFIG_FIELDS = re.compile(r"^<!-- config-fields (?P<part>top|groups) -->$", re.M)


def field_docstrings(cls: type) -> dict[str, str]:
    """Each field's docstring: the string statement right after the field in a dataclass body (and its bases')."""
    docs: dict[str, str] = {}
    for base in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
        body = ast.parse(textwrap.dedent(inspect.getsource(base))).body[0].body
        for node, after in zip(body, body[1:]):
            if (
                isinstance(node, ast.AnnAssign)
                and isinstance(node.target, ast.Name)
                and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)
            ):
                docs[node.target.id] = inspect.cleandoc(after.value.value)
    return docs


def default_config() -> tuple[dict, dict[str, str]]:
    """The config a run with no overrides composes (`conf/train.yaml`, interpolations kept), and the
    option chosen in each group (`{"correction": "tis", ...}`)."""
    from hydra import compose, initialize_config_module
    from omegaconf import OmegaConf

    import lit_grpo.config  # noqa: F401  (stores the `train_schema` node)

    with initialize_config_module(config_module="lit_grpo.conf", version_base="1.3"):
        cfg = compose(config_name="train", return_hydra_config=True)
    choices = {k: v for k, v in cfg.hydra.runtime.choices.items() if not k.startswith("hydra")}
    composed = OmegaConf.to_container(cfg, resolve=False)
    del composed["hydra"]
    return composed, choices


def _yaml(value: object) -> str:
    """A value as it is written on the command line or in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return value or "''"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(map(_yaml, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    return repr(value)


def _dataclass_default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return "???"  # OmegaConf's mark of a required value


def _field_rows(cls: type, prefix: str, composed: dict, choices: dict[str, str], *, with_dicts: bool) -> list[str]:
    """One table row per field of `cls` that is not a group of its own: name, the default a run
    gets, the first sentence of its docstring. A default the YAML changes names the dataclass's too."""
    docs, hints = field_docstrings(cls), typing.get_type_hints(cls)
    rows = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        if dataclasses.is_dataclass(kind) or (not with_dicts and (kind is dict or typing.get_origin(kind) is dict)):
            continue
        schema = _dataclass_default(f)
        value = composed.get(f.name, schema)
        shown = f"`{_cell(_yaml(value))}`"
        if value != schema:
            group = prefix.split(".")[0]
            source = f"{group}={choices[group]}" if group in choices else "conf/train.yaml"
            shown += f" (`{source}`; the dataclass: `{_cell(_yaml(schema))}`)"
        rows.append(f"| `{prefix}{f.name}` | {shown} | {_summary(docs.get(f.name, ''))} |")
    return rows


_FIELD_HEADER = ["| field | default | meaning |", "|---|---|---|"]


def config_fields(part: str) -> str:
    """`top`: a table of `TrainConfig`'s own fields; `groups`: one table per config group
    dataclass (nested ones too, such as `model.lora`). Made from the dataclasses, their field
    docstrings and the default composed config, so it cannot drift from them."""
    from lit_grpo.config import TrainConfig

    composed, choices = default_config()
    if part == "top":
        return "\n".join(_FIELD_HEADER + _field_rows(TrainConfig, "", composed, choices, with_dicts=False))
    sections = []
    todo = [(TrainConfig, "", composed)]
    while todo:
        cls, prefix, values = todo.pop(0)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if dataclasses.is_dataclass(hints[f.name]):
                name = prefix + f.name
                group_values = values.get(f.name, {})
                rows = _field_rows(hints[f.name], name + ".", group_values, choices, with_dicts=True)
                sections.append("\n".join([f"### `{name}`", "", *_FIELD_HEADER, *rows]))
                todo.append((hints[f.name], name + ".", group_values))
    return "\n\n".join(sections)


_MOVED_KEYS = re.compile(r"^<!-- moved-keys -->$", re.M)


def moved_keys_table() -> str:
    """One row per config key that moved (`lit_grpo.config.moved.MOVED`): its old and new name,
    and the values that are renamed with it."""
    from lit_grpo.config.moved import MOVED, MOVED_VALUES

    rows = ["| old key | new key |", "|---|---|"]
    for old, new in MOVED.items():
        values = MOVED_VALUES.get(old)
        shown = ", ".join(f"`{old}={a}` is `{new}={b}`" for a, b in values.items()) if values else f"`{new}`"
        rows.append(f"| `{old}` | {_cell(shown)} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, page, config, **kwargs) -> str:
    """Fill in the tables made from the code: modules, `make` targets, config fields, moved keys."""
    root = Path(config.config_file_path).parent
    markdown = _MODULE_TABLE.sub(lambda m: module_table(root / "lit_grpo"), markdown)
    markdown = _MAKE_TARGETS.sub(lambda m: make_table(root / "Makefile", m["prefix"] or ""), markdown)
    markdown = _MOVED_KEYS.sub(lambda m: moved_keys_table(), markdown)
    return _CONFIG_FIELDS.sub(lambda m: config_fields(m["part"]), markdown)
