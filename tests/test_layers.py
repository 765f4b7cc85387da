"""The package's imports run one way: every `import` of lit_grpo, at module level, inside a
function or under `if TYPE_CHECKING:`, goes to a layer at or below its own, and no chain of
imports comes back to where it started. The layers, lowest first, are `lit_grpo.LAYERS`,
documented in `lit_grpo/__init__.py`. Code sits where its job is: each registry entry is
registered in the module that defines it, and no module grows into a god-file."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

import lit_grpo

PACKAGE = Path(lit_grpo.__file__).resolve().parent
LAYERS = lit_grpo.LAYERS
ROOT_MODULES_AT_MOST = 8
MODULE_LINES_AT_MOST = 600
"""A ceiling against god-files, not a target: a module is split when it holds two jobs, never for its length."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in PACKAGE.rglob("*.py")}


def _layer(module: str) -> int:
    """The index in LAYERS of the wing that holds `module` (the longest name that is it or its package)."""
    holders = [
        (len(name), i)
        for i, wing in enumerate(LAYERS)
        for name in wing
        if module == name or module.startswith(name + ".")
    ]
    assert holders, f"{module} is in no layer of lit_grpo.LAYERS: add it there"
    return max(holders)[1]


def _imports(module: str) -> set[str]:
    """The lit_grpo modules `module` imports anywhere in its body: inside functions and under
    `if TYPE_CHECKING:` too."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(encoding="utf-8"))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from pkg import sub` imports the submodule when there is one
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        found.update(n for n in names if n.split(".")[0] == "lit_grpo" and n in MODULES and n != module)
    return found


GRAPH = {m: _imports(m) for m in MODULES}
"""What each module imports: every edge runs down the layers, and no chain comes back."""


def test_every_module_sits_in_a_layer():
    for module in MODULES:
        _layer(module)


def test_imports_run_down_the_layers():
    upward = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)})"
        for m, targets in GRAPH.items()
        for t in targets
        if _layer(t) > _layer(m)
    ]
    assert not upward, "imports that run up the layers:\n" + "\n".join(sorted(upward))


def _cycles() -> list[list[str]]:
    """Every strongly connected set of two or more modules (Tarjan), as a sorted list."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert not _cycles(), "import cycles (function-level imports included):\n" + "\n".join(
        " <-> ".join(c) for c in _cycles()
    )


def test_the_cycle_finder_finds_a_cycle(monkeypatch):
    monkeypatch.setitem(GRAPH, "lit_grpo.types", GRAPH["lit_grpo.types"] | {"lit_grpo.errors"})
    monkeypatch.setitem(GRAPH, "lit_grpo.errors", GRAPH["lit_grpo.errors"] | {"lit_grpo.types"})
    assert ["lit_grpo.errors", "lit_grpo.types"] in _cycles()


def test_the_root_reads_as_a_table_of_contents():
    root = sorted(p.name for p in PACKAGE.glob("*.py"))
    assert len(root) <= ROOT_MODULES_AT_MOST, root


def test_no_module_over_600_lines():
    long = {
        m: n
        for m, p in MODULES.items()
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > MODULE_LINES_AT_MOST
    }
    assert not long, long


def _registries() -> dict[str, tuple[str, dict[str, str]]]:
    """Each registry of functions in the package: the call that fills it, and where each entry's
    function is defined (name -> module)."""
    from lit_grpo.advantages.registry import ADVANTAGES
    from lit_grpo.maths.correction import CORRECTIONS
    from lit_grpo.maths.losses import POLICY_LOSSES
    from lit_grpo.rewards.registry import REWARDS

    def modules(registry: dict) -> dict[str, str]:
        return {name: getattr(entry, "fn", entry).__module__ for name, entry in registry.items()}

    return {
        "policy loss": ("register_policy_loss", modules(POLICY_LOSSES)),
        "advantage": ("register_advantage", modules(ADVANTAGES)),
        "correction": ("register_correction", modules(CORRECTIONS)),
        "reward": ("register_reward", modules(REWARDS)),
    }


def _registered_names(module: str, decorator: str) -> set[str]:
    """The names `module`'s own source registers with `decorator("name", ...)` (a decorator or a call)."""
    tree = ast.parse(Path(sys.modules[module].__file__).read_text(encoding="utf-8"))
    return {
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == decorator
        and node.args
        and isinstance(node.args[0], ast.Constant)
    }


@pytest.mark.parametrize("what", ["policy loss", "advantage", "correction", "reward"])
def test_every_built_in_entry_is_registered_where_it_is_defined(what):
    decorator, modules = _registries()[what]
    built_in = {name: module for name, module in modules.items() if module.startswith("lit_grpo.")}
    assert built_in, what
    elsewhere = {name: module for name, module in built_in.items() if name not in _registered_names(module, decorator)}
    assert not elsewhere, f"{what} entries registered outside the module that defines them: {elsewhere}"


def test_the_placement_check_reads_each_module_alone():
    # losses.py registers nothing itself: it only imports the families that do.
    assert _registered_names("lit_grpo.maths.losses", "register_policy_loss") == set()
    assert {"sapo", "gmpo", "dppo", "vespo"} <= _registered_names(
        "lit_grpo.maths.trust_region_losses", "register_policy_loss"
    )
    assert {"gspo", "luspo"} <= _registered_names("lit_grpo.maths.ppo_losses", "register_policy_loss")


def test_each_sampler_builder_lives_beside_its_sampler_and_reads_no_model_module():
    import importlib

    from lit_grpo.samplers import SAMPLERS

    for kind in ("hf", "vllm", "vllm_server"):
        module, _, function = SAMPLERS[kind].builder.partition(":")
        assert module.startswith("lit_grpo.samplers.") and callable(getattr(importlib.import_module(module), function))
    # The weights come from lit_grpo.build (samplers.StartingWeights): no builder reaches into lit_grpo.models.
    for module in ("lit_grpo.samplers", "lit_grpo.samplers.vllm", "lit_grpo.samplers.server.build"):
        assert not {t for t in GRAPH[module] if t.startswith("lit_grpo.models")}, module


def test_the_sampler_registry_imports_no_backend():
    # Config validation reads the kinds: that must not load a sampler (transformers, vLLM's client).
    import subprocess

    code = "import sys, lit_grpo.samplers; print([m for m in sys.modules if m.startswith('lit_grpo.samplers.')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
