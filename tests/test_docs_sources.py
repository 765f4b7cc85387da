"""The parts of the docs that restate the code are made from it or checked against it: the README's
layout (checked), the `make` targets (made by `docs/hooks.py`, and every `make X` the docs name
checked), the benchmarks' folders and paths (checked), the config fields with their defaults and
meanings (made by `docs/hooks.py`), and every config key and group choice the docs write (checked)."""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import re
import shutil
import subprocess
import typing
from pathlib import Path
from types import SimpleNamespace

import pytest
from omegaconf import OmegaConf

from lit_grpo.config import TrainConfig

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lit_grpo"
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _load_hooks():
    spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


hooks = _load_hooks()


def rendered(page: str) -> str:
    """`docs/<page>` as the site build hands it to Markdown, the hook's tables filled in."""
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    return hooks.on_page_markdown(text, page=None, config=SimpleNamespace(config_file_path=str(ROOT / "mkdocs.yml")))


# --- the README's layout -------------------------------------------------------------------------


def readme_layout() -> list[tuple[list[str], str]]:
    """The README's `## Layout` block: per line, the paths of its first column and the whole line."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    block = section.split("```", 2)[1].split("\n", 1)[1]
    entries = []
    for line in block.splitlines():
        first = re.split(r"\s{2,}", line.strip(), maxsplit=1)[0]
        paths = [p.strip() for p in first.split(",")]
        folder = paths[0].rsplit("/", 1)[0] + "/" if "/" in paths[0].rstrip("/") else ""
        entries.append(([paths[0], *(folder + p for p in paths[1:])], line))
    return entries


def test_readme_layout_names_every_package_and_root_module():
    listed = {path for paths, _ in readme_layout() for path in paths}
    packages = sorted(f"lit_grpo/{d.name}/" for d in PACKAGE.iterdir() if (d / "__init__.py").exists())
    assert [p for p in packages if p not in listed] == [], "packages missing from the README's layout"
    text = "\n".join(line for _, line in readme_layout())
    modules = sorted(p.name for p in PACKAGE.glob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if not re.search(rf"(?<![\w.]){re.escape(m)}\b", text)] == []


def test_readme_layout_lists_only_what_exists():
    listed = [path for paths, _ in readme_layout() for path in paths]
    assert listed, "the README has no layout block"
    assert [p for p in listed if not (ROOT / p).exists()] == [], "the README's layout lists what is not on disk"


# --- make targets --------------------------------------------------------------------------------


def all_targets() -> set[str]:
    """Every rule of the Makefile, documented (`## `) or not."""
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([a-zA-Z][\w-]*):(?!=)", text, flags=re.M))


def test_the_docs_name_only_make_targets_that_exist():
    """`make X` in a code span or block of the README or a page (a variable such as PYTHON=... skipped)."""
    unknown = []
    for path in MARKDOWN:
        code = "\n".join(re.findall(r"```.*?```|`[^`\n]+`", path.read_text(encoding="utf-8"), flags=re.S))
        for target in re.findall(r"(?<![\w-])make ([a-z][\w-]*)(?![\w=-])", code):
            if target not in all_targets():
                unknown.append(f"{path.relative_to(ROOT)}: make {target}")
    assert unknown == [], "make targets the Makefile does not have"


def test_getting_started_lists_every_documented_target():
    page = rendered("getting-started.md")
    targets = hooks.make_targets(ROOT / "Makefile")
    assert len(targets) >= 10
    assert [t for t in targets if f"| `make {t}` |" not in page] == []


def test_the_benchmark_table_lists_every_benchmark_target():
    page = rendered("development.md")
    benches = [t for t in hooks.make_targets(ROOT / "Makefile") if t.startswith("bench")]
    assert benches and [t for t in benches if f"| `make {t}` |" not in page] == []


@pytest.mark.skipif(shutil.which("make") is None, reason="no make on this machine")
def test_the_hook_reads_the_targets_make_help_prints():
    out = subprocess.run(
        ["make", "-s", "--no-print-directory", "help"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    printed = [line.split()[0] for line in out.stdout.splitlines() if line.strip()]
    assert printed == list(hooks.make_targets(ROOT / "Makefile"))


# --- the benchmarks' folders ---------------------------------------------------------------------

BENCHMARKS = ROOT / "benchmarks"


def _docstring(init: Path) -> str:
    return ast.get_docstring(ast.parse(init.read_text(encoding="utf-8"))) or ""


def test_each_benchmark_folder_lists_its_files_and_benchmarks_lists_each_folder():
    """benchmarks/ is grouped by what each benchmark measures: its docstring names every folder, each
    folder's docstring every file beside it (a line that starts with the name), with targets that exist."""
    folders = sorted(init.parent for init in BENCHMARKS.glob("*/__init__.py"))
    assert [p.name for p in BENCHMARKS.glob("*.py") if p.name != "__init__.py"] == [], "a benchmark outside a folder"
    top = _docstring(BENCHMARKS / "__init__.py")
    assert [f.name for f in folders if not re.search(rf"^\s*{f.name}/\s", top, re.M)] == []
    unlisted, unknown = [], []
    for folder in folders:
        doc = _docstring(folder / "__init__.py")
        files = sorted(p.name for p in folder.iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py")
        unlisted += [f"{folder.name}/{f}" for f in files if not re.search(rf"^\s*{re.escape(f)}\s", doc, re.M)]
        unknown += [f"{folder.name}: make {t}" for t in re.findall(r"`make ([\w-]+)`", doc) if t not in all_targets()]
    assert unlisted == [], "files missing from their folder's docstring"
    assert unknown == []


def test_every_benchmark_path_named_exists():
    """`benchmarks.<folder>.<module>` (to run or import; after it, attributes) and
    `benchmarks/<folder>/<file>.py` in the Makefile, the pages, the configs, the tests and the code
    name a file that exists: a benchmark that moves leaves no stale command behind."""
    sources = [ROOT / "Makefile", *MARKDOWN, *PACKAGE.rglob("*.py"), *PACKAGE.rglob("*.yaml")]
    sources += [*(ROOT / "tests").glob("*.py"), *BENCHMARKS.rglob("*.py"), *BENCHMARKS.rglob("*.sh")]
    stale = []
    for source in sources:
        text = source.read_text(encoding="utf-8")
        for dotted in re.findall(r"(?<![\w/.-])benchmarks((?:\.[a-z_]\w*)+)", text):
            here = BENCHMARKS
            for part in dotted.split(".")[1:]:  # a package's next part is a module or a package
                if (here / f"{part}.py").exists():
                    break
                here = here / part
                if not (here / "__init__.py").exists():
                    stale.append(f"{source.relative_to(ROOT)}: benchmarks{dotted}")
                    break
        for path in re.findall(r"(?<![\w/.-])benchmarks/[\w/]+\.(?:py|sh)\b", text):
            if not (ROOT / path).exists():
                stale.append(f"{source.relative_to(ROOT)}: {path}")
    assert stale == [], "benchmark paths that do not exist"


# --- config fields -------------------------------------------------------------------------------


def config_fields(cls: type = TrainConfig, prefix: str = "") -> list[tuple[str, type, dataclasses.Field]]:
    """(dotted name, owning dataclass, field) of every field, groups' fields included."""
    found = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        found.append((prefix + f.name, cls, f))
        if dataclasses.is_dataclass(hints[f.name]):
            found += config_fields(hints[f.name], f"{prefix}{f.name}.")
    return found


def test_every_config_field_has_a_docstring():
    """The docstring is the field's documentation (the reference pages and the tables are made from it);
    a group's field is documented by its dataclass."""
    hints = {cls: typing.get_type_hints(cls) for _, cls, _ in config_fields()}
    missing = [
        name
        for name, cls, f in config_fields()
        if not dataclasses.is_dataclass(hints[cls][f.name]) and f.name not in hooks.field_docstrings(cls)
    ]
    assert missing == [], "config fields without a docstring"


def test_the_config_page_shows_every_field_with_the_default_a_run_gets():
    """Against the config `python -m lit_grpo.train` composes (`lit_grpo.train.compose_config`)."""
    from lit_grpo.train import compose_config

    page = rendered("reference/config.md")
    assert "<!-- config-fields" not in page
    defaults = OmegaConf.to_container(compose_config([]), resolve=False)
    hints = {cls: typing.get_type_hints(cls) for _, cls, _ in config_fields()}
    wrong = []
    for name, cls, f in config_fields():
        kind = hints[cls][f.name]
        if dataclasses.is_dataclass(kind) or ("." not in name and kind is dict):
            continue  # a group: a table of its own (`task`, `callbacks`, `logger`: free-form, on the groups' table)
        value = defaults
        for part in name.split("."):
            value = value[part]
        row = f"| `{name}` | `{hooks._cell(hooks._yaml(value))}`"
        if row not in page:
            wrong.append(row)
    assert wrong == [], "config fields missing from docs/reference/config.md, or shown with another default"


def test_a_field_the_yaml_changes_shows_both_defaults():
    page = rendered("reference/config.md")
    assert "| `correction.cap` | `5.0` (`correction=tis`; the dataclass: `null`) |" in page


# --- config keys and choices the docs write -----------------------------------------------------

NOT_KEYS = {
    "sampler.score": "the Sampler protocol's method, `lit_grpo.types.Sampler.score`",
    "data.sampler.class_path": "verl's key (docs/guides/algorithm-menu.md's peers' names)",
    "data.sampler.class_name": "verl's key (docs/guides/algorithm-menu.md's peers' names)",
}
"""Dotted names that start like a config key and are not one."""
OLD_NAMES_PAGE = "docs/reference/moved.md"
"""Names what moved: its old keys are gone from the schema on purpose."""
CODE = re.compile(r"```.*?```|`[^`\n]+`", re.S)
DOTTED = re.compile(r"(?<![\w.+~/-])[+~]?([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)+)(?![\w(/-])")
OVERRIDE = re.compile(r"(?<![\w.-])[+~]?([a-z_][a-z0-9_]*)(\.[\w.]+)?=([\w,.-]+)(?![\w,.(-])")
COMMAND = re.compile(r"lit_grpo\.train|lit-grpo ")


def schema_has(key: str) -> bool:
    """Whether `a.b.c` is a field of TrainConfig (below a free-form dict field, anything is)."""
    cls: object = TrainConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return True  # `policy_loss.params.<name>`, `task.<option>`, `callbacks.<key>.<arg>`: free-form
        kinds = typing.get_type_hints(cls)
        if part not in kinds:
            return False
        cls = kinds[part]
    return True


def _code_lines() -> list[tuple[str, str]]:
    """(`file:line`, text) of every line of code, spans and blocks, in the README and the pages."""
    found = []
    for path in MARKDOWN:
        text = path.read_text(encoding="utf-8")
        for match in CODE.finditer(text):
            first = text.count("\n", 0, match.start()) + 1
            for offset, line in enumerate(match.group().splitlines()):
                found.append((f"{path.relative_to(ROOT)}:{first + offset}", line))
    return found


def test_the_docs_name_only_config_keys_that_exist():
    roots = {f.name for f in dataclasses.fields(TrainConfig)}
    wrong = [
        f"{where}: {key}"
        for where, line in _code_lines()
        if not where.startswith(OLD_NAMES_PAGE)
        for key in DOTTED.findall(line)
        if key.split(".")[0] in roots and key not in NOT_KEYS and not schema_has(key)
    ]
    assert wrong == [], "config keys the schema does not have (lit_grpo/config/)"


def test_the_docs_commands_name_only_groups_choices_and_fields_that_exist():
    """In a `python -m lit_grpo.train` / `lit-grpo` command: `group=choice` names a YAML of
    `lit_grpo/conf/<group>/` (each of a sweep's), any other override a field (a command with
    `--config-dir` brings groups of its own, and is skipped)."""
    conf = PACKAGE / "conf"
    groups = {d.name for d in conf.iterdir() if d.is_dir()}
    roots = {f.name for f in dataclasses.fields(TrainConfig)}
    wrong = []
    for where, line in _code_lines():
        if not COMMAND.search(line) or "--config-dir" in line:
            continue
        for root, rest, values in OVERRIDE.findall(line):
            if root in groups and not rest:
                wrong += [f"{where}: {root}={v}" for v in values.split(",") if not (conf / root / f"{v}.yaml").exists()]
            elif root != "hydra" and (root not in roots or not schema_has(root + rest)):
                wrong.append(f"{where}: {root}{rest}")
    assert wrong == [], "overrides naming a choice or a field that does not exist"


def test_the_moved_page_lists_every_moved_key():
    from lit_grpo.config.moved import MOVED

    page = rendered("reference/moved.md")
    assert "<!-- moved-keys -->" not in page
    for old, new in MOVED.items():
        assert f"| `{old}` |" in page and f"`{new}" in page, old
