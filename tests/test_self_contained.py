"""The repository carries everything its tests need: a copy of its tracked files, in a folder with
nothing beside it, passes the data tests, and no tracked file points outside the repository."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# The tests that read data files: the GSM8K reward's labelled solutions and the row loaders.
DATA_TESTS = ["tests/test_gsm8k_reward.py", "tests/test_gsm8k_rows.py"]
# A path that climbs out of the checkout into a sibling folder (`../shared/...`, `../data`).
OUTSIDE = re.compile(r"\.\./(shared|data|seeds)\b|parents\[[2-9]\]\s*/\s*\"shared\"")


def _tracked_files() -> list[Path]:
    if not (REPO / ".git").exists():
        pytest.fail("the self-containment checks need a git checkout (`git ls-files` lists what a clone holds)")
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60).stdout
    return [REPO / name for name in out.decode().split("\0") if name and (REPO / name).is_file()]


def test_no_tracked_file_points_outside_the_repository():
    hits = []
    for path in _tracked_files():
        if path.suffix in {".gz", ".png"} or path == Path(__file__).resolve():
            continue
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), start=1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(REPO)}:{n}: {line.strip()[:100]}")
    assert not hits, "tracked files point outside the repository:\n" + "\n".join(hits)


@pytest.mark.timeout(300)
def test_the_data_tests_pass_from_a_copy_with_nothing_beside_it(tmp_path):
    clone = tmp_path / "alone" / "lit_grpo_clone"
    for path in _tracked_files():
        target = clone / path.relative_to(REPO)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target)
    assert sorted(p.name for p in clone.parent.iterdir()) == ["lit_grpo_clone"]
    # The copy's own package first on the path, so nothing is read through the checkout's install.
    env = {**os.environ, "PYTHONPATH": str(clone)}
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *DATA_TESTS],
        cwd=clone,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(r"\b\d+ passed\b", proc.stdout) and " failed" not in proc.stdout, proc.stdout[-1000:]
