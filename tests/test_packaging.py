"""Installable like a library: the wheel carries the Hydra configs, the installed `lit-grpo` command
trains outside the checkout, a user's own config folder plugs in with `--config-dir`, and a fresh
run does not greet the user with Lightning's warning about a non-empty log folder.

The end-to-end tests build the wheel from a copy of the sources, install it into a fresh virtual
environment (its dependencies taken from the test's own environment, its requirements checked
against them) and run the installed command from a folder outside the checkout, so nothing of the
checkout can stand in for what the wheel lacks.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import warnings
import zipfile
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

REPO = Path(__file__).resolve().parents[1]
NOT_EMPTY = "exists and is not empty"  # Lightning's CSV logger warning about its folder
USER_EXPERIMENT = """\
# @package _global_
# A user's experiment: the built-in arithmetic demo, changed.
defaults:
  - arithmetic

task:
  num_rows: 64
max_steps: 2
"""


def _run(cmd: list[str], cwd: Path, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run `cmd` without the checkout on the import path; fail with its output when it fails."""
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


CHECK_REQUIREMENTS = """
from importlib.metadata import PackageNotFoundError, requires, version
from packaging.requirements import Requirement
bad = []
for line in requires("lit_grpo"):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue  # an extra's requirement
    try:
        if not req.specifier.contains(version(req.name), prereleases=True):
            bad.append(f"{req} (installed {version(req.name)})")
    except PackageNotFoundError:
        bad.append(f"{req} (not installed)")
assert not bad, "the wheel's requirements are not met: " + ", ".join(bad)
"""
"""The wheel's own requirements (without extras) hold in the environment it was installed into."""


def _run_folder(cwd: Path) -> Path:
    """The one Hydra run folder (`outputs/<date>/<time>/`) a run started in `cwd` wrote."""
    folders = [p.parent for p in (cwd / "outputs").glob("*/*/summary.json")]
    assert len(folders) == 1, folders
    return folders[0]


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> dict:
    """The wheel, built from a copy of the sources, installed into a fresh venv: its paths."""
    root = tmp_path_factory.mktemp("packaging")
    src = root / "src"  # a copy: the build writes build/ and *.egg-info, which must not land in the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "lit_grpo", src / "lit_grpo", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels = root / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(src)], cwd=root)
    (wheel,) = wheels.glob("lit_grpo-*.whl")

    venv = root / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], cwd=root)
    python = venv / "bin" / "python"
    # The dependencies (torch, lightning, ...) come from this interpreter's site-packages, added as a
    # plain path entry: its .pth files (the checkout's editable install among them) are not run, so
    # the only lit_grpo the venv can import is the wheel's. Installing them again would only time pip.
    purelib = _run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=root
    ).stdout.strip()
    Path(purelib, "_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(python), "-m", "pip", "install", "-q", "--no-deps", str(wheel)], cwd=root, timeout=900)
    _run([str(python), "-c", CHECK_REQUIREMENTS], cwd=root)
    return {"wheel": wheel, "src": src, "python": python, "command": venv / "bin" / "lit-grpo", "root": root}


@pytest.mark.slow
@pytest.mark.timeout(900)  # includes the module fixture: the wheel build and the venv
def test_the_wheel_carries_every_config(installed):
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    shipped = sorted(
        p.relative_to(installed["src"]).as_posix() for p in (installed["src"] / "lit_grpo" / "conf").rglob("*.yaml")
    )
    assert "lit_grpo/conf/train.yaml" in shipped and "lit_grpo/conf/experiment/arithmetic.yaml" in shipped
    assert [name for name in shipped if name not in names] == []
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    assert "lit-grpo = lit_grpo.train:cli" in zipfile.ZipFile(installed["wheel"]).read(entry_points).decode()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_wheel_carries_the_bundled_data(installed):
    """The GSM8K rows of `task.path=bundled` with their license, and the merges of `model.kind=qwen2_shape`."""
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    folders = [installed["src"] / "lit_grpo" / part / "data" for part in ("tasks", "models")]
    data = [p.relative_to(installed["src"]).as_posix() for folder in folders for p in folder.iterdir()]
    assert {"lit_grpo/tasks/data/gsm8k_train_head.jsonl", "lit_grpo/models/data/gsm8k_merges.txt"} <= set(data)
    assert "lit_grpo/tasks/data/GSM8K_LICENSE" in data
    assert [name for name in data if name not in names] == []


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_installed_command_trains_outside_the_checkout(installed, tmp_path):
    where = _run([str(installed["python"]), "-c", "import lit_grpo; print(lit_grpo.__file__)"], cwd=tmp_path).stdout
    assert (
        Path(where.strip()).resolve().is_relative_to((installed["root"] / "venv").resolve())
    )  # the wheel's copy, not the checkout's

    _run([str(installed["command"]), "+experiment=arithmetic", "trainer.fast_dev_run=true"], cwd=tmp_path)
    assert json.loads((_run_folder(tmp_path) / "summary.json").read_text())["steps"] == 1


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_users_config_dir_adds_experiments(installed, tmp_path):
    (tmp_path / "my_conf" / "experiment").mkdir(parents=True)
    (tmp_path / "my_conf" / "experiment" / "mine.yaml").write_text(USER_EXPERIMENT)
    proc = _run(
        [str(installed["command"]), "--config-dir", "my_conf", "+experiment=mine", "trainer.enable_progress_bar=false"],
        cwd=tmp_path,
    )
    run = _run_folder(tmp_path)
    assert json.loads((run / "summary.json").read_text())["steps"] == 2  # the user's max_steps
    config = (run / ".hydra" / "config.yaml").read_text()
    assert "num_rows: 64" in config and "kl_beta: 0.1" in config  # the user's change over the built-in experiment
    # A fresh run with the CSV logger on (fast_dev_run has none): Hydra's files share its folder, unremarked.
    assert (run / "metrics.csv").is_file() and (run / ".hydra").is_dir()
    assert NOT_EMPTY not in proc.stderr


@pytest.mark.timeout(120)
def test_the_csv_logger_does_not_warn_about_the_run_folders_own_files(tmp_path):
    # Hydra's files and the run lock are in the run folder before the logger starts.
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra" / "config.yaml").write_text("seed: 0\n")
    (tmp_path / "train.log").write_text("")
    shipped = OmegaConf.load(REPO / "lit_grpo" / "conf" / "logger" / "csv.yaml")
    logger = instantiate(OmegaConf.merge({"output_dir": str(tmp_path)}, {"logger": shipped}).logger.csv)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # train.py's filters must not be what keeps it quiet
        logger.log_metrics({"reward/mean": 0.5}, step=0)
        logger.save()
    assert [str(w.message) for w in caught if NOT_EMPTY in str(w.message)] == []
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0].split(",") == ["reward/mean", "step"]
    assert (tmp_path / ".hydra" / "config.yaml").is_file() and (tmp_path / "train.log").is_file()
