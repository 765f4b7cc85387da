"""The cluster rehearsal's short version (`python -m benchmarks.cluster.rehearse --short`, what
`make rehearse-cluster` runs in full): lit_grpo trained by torchrun across two namespace "hosts"
ends 0 on both and equals, bit for bit, the same run as 2 processes on one node; the trainer on
node 1 killed stops node 0 within 60 s with one message naming rank 1 and the last checkpoint,
no traceback of lit_grpo's, nothing left running, the checkpoints whole; the relaunch with
`resume=auto` finishes bit-identical. Root and `ip netns` needed: skipped with the reason elsewhere."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # benchmarks/ is not in the installed package
from benchmarks.cluster.netns import available  # noqa: E402
from benchmarks.cluster.rehearse import main  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(autouse=True)
def _needs_network_namespaces():
    reason = available()
    if reason:
        pytest.skip(reason)


def test_the_short_rehearsal_trains_across_two_nodes_and_survives_a_killed_trainer(tmp_path):
    out = tmp_path / "result.json"
    code = main(["--short", "--steps", "24", "--work-dir", str(tmp_path / "work"), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["bit_identical_one_node"] == {"ddp": True}, result
    clean, killed = result["outcomes"]
    assert clean["codes"] == {"train-0": 0, "train-1": 0}, clean
    assert killed["fault"] == "kill-train-1"
    assert killed["errors"]["train-0"].startswith("error: rank 1 (train-1 (pid "), killed
    assert "the last saved checkpoint is step" in killed["errors"]["train-0"], killed
    assert all(code != 0 for code in killed["codes"].values()), killed
    assert killed["stop_s"] is not None and killed["stop_s"] < 60, killed
    assert not killed["tracebacks"] and not killed["left_running"] and killed["checkpoints_whole"], killed
    assert killed["resumed_bit_identical"], killed
    assert code == 0
