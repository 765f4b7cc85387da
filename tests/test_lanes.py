"""`tests/lanes.py` names tests that exist, each marked slow, and they leave CI's slow lane for the nightly one."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from lanes import NIGHTLY_ONLY

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow  # collects some 20 files (about 30 s)
@pytest.mark.timeout(300)
def test_every_nightly_only_id_is_a_slow_test_of_the_nightly_lane():
    files = sorted({nid.split("::")[0] for nid in NIGHTLY_ONLY})
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", "slow and nightly",
         *files],
        cwd=REPO, capture_output=True, text=True, timeout=280,
    )  # fmt: skip
    nightly = {line.strip() for line in out.stdout.splitlines() if "::" in line}
    # A renamed or removed test is named here; one listed is out of `make test`'s slow lane.
    assert NIGHTLY_ONLY <= nightly, sorted(NIGHTLY_ONLY - nightly)[:5]
