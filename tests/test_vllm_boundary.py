"""The vLLM boundary: the `vllm` extra is pinned to the versions the tests ran, and a run whose
sampler uses vLLM refuses, before any model loads, a vLLM outside that range or one that lacks an
API lit_grpo calls, with one message naming the version and the API (exit code 2, no traceback)."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import sys
import tomllib
import types
from pathlib import Path

import pytest
from conftest import compose_config

from lit_grpo.config import ConfigError
from lit_grpo.errors import run_cli
from lit_grpo.run.preflight import check_sources
from lit_grpo.run.validate import validate
from lit_grpo.samplers import vllm_boundary
from lit_grpo.samplers.vllm_boundary import (
    VLLM_APIS,
    VLLM_SUPPORTED,
    installed_vllm_version,
    version_problem,
    vllm_problem,
)
from lit_grpo.train import train

REPO = Path(__file__).resolve().parents[1]
HAS_VLLM = importlib.util.find_spec("vllm") is not None


def vllm_run(tmp_path, *overrides: str):
    return compose_config("sampler=vllm", "model.num_heads=2", *overrides, output_dir=tmp_path)


def test_the_extra_pins_the_range_the_boundary_checks():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{VLLM_SUPPORTED}"]


@pytest.mark.parametrize(
    "version, inside",
    [
        ("0.32.0", True),
        ("0.32.0+cpu", True),
        ("0.32.4", True),
        ("0.32.1rc1", True),
        ("0.31.9", False),
        ("0.33.0", False),
        ("1.0.0", False),
        ("not-a-version", False),
    ],
)
def test_the_range(version, inside):
    assert (version_problem(version) is None) == inside


@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
def test_the_installed_vllm_is_inside_the_range():
    assert version_problem(installed_vllm_version()) is None


def test_a_vllm_outside_the_range_is_refused_before_any_model_loads(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(vllm_boundary, "installed_vllm_version", lambda: "0.31.0")
    monkeypatch.setattr(vllm_boundary, "missing_apis", lambda names: pytest.fail("the API is checked only in range"))
    monkeypatch.setitem(sys.modules, "lit_grpo.build", None)  # importing the run's builder (models, samplers) fails
    with pytest.raises(ConfigError) as refused:
        check_sources(validate(vllm_run(tmp_path)))
    message = str(refused.value)
    assert "sampler=vllm: vLLM 0.31.0 is installed" in message and f"vllm{VLLM_SUPPORTED}" in message
    with pytest.raises(SystemExit) as stopped:  # the command line: its message, exit code 2, no traceback
        run_cli(train, vllm_run(tmp_path))
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert "vLLM 0.31.0 is installed" in err and "Traceback" not in err and err.count("error:") == 1


def _fake_vllm(monkeypatch, *, without: str) -> None:
    """A vLLM in `sys.modules` that has every name of VLLM_APIS["vllm"] but `without`."""
    modules: dict[str, types.ModuleType] = {}
    for module_name, path in VLLM_APIS["vllm"]:
        if module_name not in modules:
            modules[module_name] = types.ModuleType(module_name)
            modules[module_name].__spec__ = importlib.machinery.ModuleSpec(module_name, None)  # found, as installed
        module = modules[module_name]
        owner, *methods = path.split(".")
        if not hasattr(module, owner):
            setattr(module, owner, type(owner, (), {}))
        for name in methods:
            if f"{module_name}.{path}" != without:
                setattr(getattr(module, owner), name, lambda *args, **kwargs: None)
    for module_name, module in modules.items():
        monkeypatch.setitem(sys.modules, module_name, module)


def test_a_vllm_without_an_api_lit_grpo_calls_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(vllm_boundary, "installed_vllm_version", lambda: "0.32.0")
    _fake_vllm(monkeypatch, without="vllm.entrypoints.llm.LLM.collective_rpc")
    why = vllm_problem("vllm")
    assert why == (
        "the installed vLLM 0.32.0 lacks vllm.entrypoints.llm.LLM.collective_rpc, which lit_grpo calls (sampler=vllm); "
        f"install a supported vLLM: {vllm_boundary.INSTALL_HINT}"
    )
    with pytest.raises(
        ConfigError,
        match=r"sampler=vllm: the installed vLLM 0\.32\.0 lacks vllm\.entrypoints\.llm\.LLM\.collective_rpc",
    ):
        check_sources(validate(vllm_run(tmp_path)))


def test_which_runs_are_checked(monkeypatch):
    monkeypatch.setattr(vllm_boundary, "installed_vllm_version", lambda: "0.40.0")
    assert vllm_problem("hf") is None
    assert vllm_problem("vllm_server") is None  # attached to servers elsewhere, weights by file: no vLLM here
    for kind, transfer, starts in [
        ("vllm", "reload", False),
        ("vllm_server", "reload", True),
        ("vllm_server", "gloo", False),
    ]:
        assert "vLLM 0.40.0 is installed" in vllm_problem(kind, transfer, starts)
    monkeypatch.setattr(vllm_boundary, "installed_vllm_version", lambda: None)
    assert vllm_problem("vllm") is None  # not installed: the sampler registry's `missing` says so


@pytest.mark.vllm
@pytest.mark.skipif(not HAS_VLLM, reason="vLLM is not installed")
@pytest.mark.timeout(300)
def test_the_installed_vllm_has_every_api_lit_grpo_calls():
    for use, names in VLLM_APIS.items():
        if use == "nccl" and not importlib.util.find_spec("vllm.distributed.weight_transfer.nccl_engine"):
            continue
        assert vllm_boundary.missing_apis(names) == [], use
