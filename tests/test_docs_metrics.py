"""Every metric the documentation names is one the code logs.

The names are collected from the guides (`README.md`, `docs/**/*.md`) and from the docstrings and
comments of `lit_grpo/`: in a code span, anything shaped like a metric (`rollout/failures`,
`train/drift/k1`, `reward/<name>`, `perf/*`); in prose, such a word whose namespace the code logs
under. What the code logs is read from its source, statically:

- a string literal shaped like a metric (not a docstring) is logged as it is, except in
  `lit_grpo/maths/`, whose pure functions hand their dicts to the loop: `lit_grpo/loop/optimizer_step.py`
  logs the loss's and the drift terms' keys as `f"train/{key}"`; a maths key is logged as it is
  only under a namespace the rest of the code logs under too (the rollout health, which
  `lit_grpo/rollouts/pipeline.py` logs as it is);
- an f-string shaped like a metric builds a family (`f"rollout/dropped_{problem}"`), which must be
  declared in `FAMILIES` below with the names it can take and its source; a family in the code
  that is not declared, or declared and no longer built, fails too.

A placeholder (`<name>`) stands for a family's open part; a glob (`perf/*`) must match a logged name.
"""

from __future__ import annotations

import ast
import fnmatch
import io
import re
import tokenize
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Optional

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lit_grpo"
MATHS = PACKAGE / "maths"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]

_PART = r"(?:[a-z0-9_*]|<[a-z_ ]+>)+"
METRIC = re.compile(rf"[a-z][a-z0-9_]*(?:/{_PART})+")
"""A metric as written: lowercase namespace, `/`, name (`train/drift/k1`), with placeholders or globs."""
IN_TEXT = re.compile(rf"(?<![\w/.<>*{{-]){METRIC.pattern}(?![\w/.<>*({{-])")
CODE_SPAN = re.compile(r"`([^`\n]+)`")
KEY = re.compile(r"[a-z][a-z0-9_]*(?:/[a-z0-9_]+)+")
"""A metric key the code builds from a literal."""
PLACEHOLDER = re.compile(r"<[a-z_ ]+>")

NOT_METRICS = {
    "openai/gsm8k": "a Hugging Face dataset",
    "clip_ratio_low/high": "verl's two config keys",
    "weight_sync_dir/<name>": "a folder",
    "dir/name": "a path's shape",
    "folder/filename": "a path's shape",
    "token_mask/sequence_mask": "two names",
    "url/health": "a server's endpoint",
    "trainer/global_step": "W&B's step axis of the reward histogram",
    "eval/step": "a key of old checkpoints' evaluator state",
    "application/json": "an HTTP content type",
}
"""Names shaped like a metric, in the docs or as literals in the code, that are not one."""

RETIRED = {"tis/weight_mean", "tis/clip_frac"}
"""Names no longer logged, which `docs/reference/moved.md` (and only it) may name as what they became."""


def _is_docstring(parents: dict[ast.AST, ast.AST], node: ast.Constant) -> bool:
    return isinstance(parents.get(node), ast.Expr)  # a bare string statement: a docstring, logs nothing


@dataclass(frozen=True)
class Source:
    """What one module's source says: literals and f-string patterns in its code, and its prose."""

    literals: frozenset[str]
    fstrings: frozenset[str]
    """f-strings shaped like a metric, each formatted part written `{}`: `rollout/dropped_{}`."""
    prose: tuple[tuple[int, str], ...]
    """(line, text) of each docstring and comment."""


@cache
def source(path: Path) -> Source:
    text = path.read_text(encoding="utf-8")
    tree = ast.parse(text)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    literals, fstrings, prose = set(), set(), []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            pattern = "".join(
                part.value if isinstance(part, ast.Constant) else "{}" for part in node.values
            )  # literal parts of an f-string are Constants too: skipped below by their parent
            if KEY.fullmatch(pattern.replace("{}", "x")) and not pattern.startswith("{}"):
                fstrings.add(pattern)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            if _is_docstring(parents, node):
                prose.append((node.lineno, node.value))
            elif not isinstance(parents.get(node), (ast.JoinedStr, ast.FormattedValue)):
                literals.add(node.value)
    for token in tokenize.generate_tokens(io.StringIO(text).readline):
        if token.type == tokenize.COMMENT:
            prose.append((token.start[0], token.string))
    return Source(frozenset(literals), frozenset(fstrings), tuple(prose))


def _modules(under: Path = PACKAGE) -> list[Path]:
    return sorted(p for p in under.rglob("*.py") if "__pycache__" not in p.parts)


def _literals(paths: list[Path]) -> set[str]:
    return {lit for p in paths for lit in source(p).literals}


@dataclass(frozen=True)
class Family:
    """Metrics an f-string builds: `pattern` with one `{}`, filled from `members()` (None: any
    name, as a user's; then the docs write the placeholder, `reward/<name>`)."""

    pattern: str
    built_in: str
    members: Optional[Callable[[], set[str]]]
    """The names its `{}` can take, from the code; None: a user's names (a placeholder only)."""
    any_name: bool = False
    """Whatever name it is given is logged (a finish reason a rollout reports): any name passes."""

    def matches(self, name: str) -> bool:
        head, tail = self.pattern.split("{}")
        if not (name.startswith(head) and name.endswith(tail) and len(name) > len(head) + len(tail)):
            return False
        part = name[len(head) : len(name) - len(tail)]
        if PLACEHOLDER.fullmatch(part) or (self.any_name and re.fullmatch(r"[a-z0-9_]+", part)):
            return True
        return self.members is not None and part in self.members()


def _registered_rewards() -> set[str]:
    """The rewards a list `reward.fn` names by their registered name (a user's own: a placeholder)."""
    from lit_grpo.rewards.registry import available_rewards

    return set(available_rewards())


def _drop_reasons() -> set[str]:
    from lit_grpo.rollouts.checks import DROP_REASONS

    return set(DROP_REASONS)


def _loss_keys() -> set[str]:
    return {lit for lit in _literals(_modules(MATHS)) if KEY.fullmatch(lit) or re.fullmatch(r"[a-z][a-z0-9_]*", lit)}


def _episode_limits() -> set[str]:
    return set(_literals([PACKAGE / "envs/rollout.py"]))


FAMILIES = (
    Family("train/{}", "lit_grpo/loop/optimizer_step.py", _loss_keys),  # the loss's metrics and the drift terms
    Family("reward/{}", "lit_grpo/rewards/combine.py", None),  # a list `reward.fn`'s components, by name
    Family("eval/reward/{}", "lit_grpo/loop/evaluation.py", _registered_rewards),  # each component's held-out mean
    Family("rollout/dropped_{}", "lit_grpo/rollouts/pipeline.py", _drop_reasons),
    Family("rollout/length_{}", "lit_grpo/maths/health.py", None, any_name=True),  # each finish reason reported
    Family("igpo/ig_turn_{}", "lit_grpo/advantages/igpo.py", lambda: {str(t) for t in range(64)}),
    Family("env/limit_{}", "lit_grpo/envs/rollout.py", _episode_limits),
)
"""Every metric family the code builds with an f-string, where it is built, and its names."""


def _maths_keys() -> set[str]:
    return {lit for lit in _literals(_modules(MATHS)) if KEY.fullmatch(lit)}


@cache
def logged() -> frozenset[str]:
    """The metric names the code logs as literals (maths keys as `train/<key>` or, under a namespace
    logged elsewhere, as they are)."""
    outside = {lit for lit in _literals([p for p in _modules() if MATHS not in p.parents]) if KEY.fullmatch(lit)}
    namespaces = {name.split("/")[0] for name in outside}
    return frozenset(outside | {k for k in _maths_keys() if k.split("/")[0] in namespaces}) - set(NOT_METRICS)


def namespaces() -> set[str]:
    """The first part of every name the code logs, literal or built, and of the maths keys (`drift`)."""
    names = set(logged()) | {f.pattern for f in FAMILIES} | _maths_keys()
    return {name.split("/")[0] for name in names}


def is_logged(name: str) -> bool:
    if "*" in name:  # a glob: some name the code logs must fit it
        concrete = set(logged()) | {f"train/{k}" for k in _loss_keys() if KEY.fullmatch(f"train/{k}")}
        for family in FAMILIES:
            if family.members is not None:
                concrete |= {family.pattern.replace("{}", m) for m in family.members()}
        return any(fnmatch.fnmatchcase(c, PLACEHOLDER.sub("*", name)) for c in concrete)
    return name in logged() or any(family.matches(name) for family in FAMILIES)


def named_in(text: str, known_namespaces: set[str]) -> set[str]:
    """The metric names `text` names: anything metric-shaped in a code span, and in the rest the
    metric-shaped words under a namespace the code logs."""
    names = {m for span in CODE_SPAN.findall(text) for m in IN_TEXT.findall(span)}
    names |= {m for m in IN_TEXT.findall(CODE_SPAN.sub(" ", text)) if m.split("/")[0] in known_namespaces}
    return {n for n in names if n not in NOT_METRICS and not (ROOT / n).exists()}  # a path is no metric


def _mentions() -> dict[str, list[str]]:
    """Each metric name the docs, docstrings and comments give, with where (`file:line`)."""
    known = namespaces()
    where: dict[str, list[str]] = {}
    for doc in DOCS:
        for i, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for name in named_in(line, known):
                where.setdefault(name, []).append(f"{doc.relative_to(ROOT)}:{i}")
    for path in _modules():
        for line, text in source(path).prose:
            for name in named_in(text, known):
                where.setdefault(name, []).append(f"{path.relative_to(ROOT)}:{line}")
    return where


def _excused(name: str, place: str) -> bool:
    """A maths docstring naming its function's own key (`drift/k1`), or moved.md a retired name."""
    if place.startswith("lit_grpo/maths/"):
        return name in _maths_keys()
    return place.startswith("docs/reference/moved.md") and name in RETIRED


def test_every_metric_the_docs_name_is_logged():
    unlogged = {}
    for name, places in _mentions().items():
        if not is_logged(name) and (wrong := [p for p in places if not _excused(name, p)]):
            unlogged[name] = wrong
    assert not unlogged, "metrics named in the docs that no code logs (a name that is not a metric: NOT_METRICS):\n" + (
        "\n".join(f"  {name}: {', '.join(places)}" for name, places in sorted(unlogged.items()))
    )


def test_every_metric_the_code_logs_is_documented():
    """The other way: a name the code logs is named in the guides, itself or by a glob (`env/*`) or
    placeholder (`rollout/dropped_<reason>`); a family by its placeholder or a member."""
    named = {name for name, places in _mentions().items() if any(not p.startswith("lit_grpo/") for p in places)}
    globs = [PLACEHOLDER.sub("*", n) for n in named if "*" in n or PLACEHOLDER.search(n)]
    missing = {n for n in logged() if n not in named and not any(fnmatch.fnmatchcase(n, g) for g in globs)}
    missing |= {f.pattern for f in FAMILIES if not any(f.matches(n) for n in named)}
    assert not missing, f"logged but named in no guide (docs/guides/metrics.md lists them): {sorted(missing)}"


def test_every_metric_family_the_code_builds_is_declared():
    built = {(pattern, str(path.relative_to(ROOT))) for path in _modules() for pattern in source(path).fstrings}
    declared = {(f.pattern, f.built_in) for f in FAMILIES}
    assert built == declared, (
        f"metric f-strings not declared in FAMILIES: {sorted(built - declared)}; "
        f"declared but no longer built: {sorted(declared - built)}"
    )


def test_retired_names_are_not_logged():
    assert not RETIRED & set(logged())


@pytest.mark.parametrize(
    "name, known",
    [
        ("rollout/failures", True),
        ("train/drift/k1", True),  # a maths key, logged under train/
        ("drift/k1", False),  # ... and never as it is
        ("rollout/zero_spread_frac", True),  # a maths key under a namespace logged as it is
        ("rollout/dropped_bad_mask", True),
        ("rollout/dropped_<reason>", True),
        ("rollout/dropped_bogus", False),
        ("reward/<name>", True),
        ("reward/bogus", False),
        ("perf/*", True),
        ("tis/*", False),
        ("filter/dropped_groups", False),
    ],
)
def test_what_counts_as_logged(name, known):
    assert is_logged(name) is known


def test_names_are_found_in_code_spans_and_in_prose():
    text = "Dropped groups count in `filter/dropped_groups`, retried calls in rollout/retries (and/or)."
    assert named_in(text, namespaces()) == {"filter/dropped_groups", "rollout/retries"}
