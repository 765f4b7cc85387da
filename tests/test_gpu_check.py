"""The GPU check script (benchmarks/machine/gpu_check.sh) runs end to end in its CPU dry run: every variant
trains, and the table reports each measure, then the train-step comparison against TRL runs; on a GPU
machine the same code measures."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_gpu_check_dry_run_trains_every_variant_and_reports_each_measure(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "machine" / "gpu_check.sh"), "--dry-run", "--json", str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=560,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["failures"] == []
    results = {r["variant"]: r for r in report["results"]}
    assert set(results) == {"packed", "padded", "token_budget", "private_copy"}
    assert results["packed"]["padding_frac"] == 0  # (the dry run's rows are all of one length: nothing to pad)
    for r in results.values():
        assert r["steps"] == 2 and r["device"] == "cpu (dry run)"
        for key in ("step_s", "sample_tokens_per_s", "train_tokens_per_s", "weight_sync_s", "padding_frac"):
            assert math.isfinite(r[key]) and r[key] >= 0, (r["variant"], key, r[key])
        assert r["peak_rss_mib"] > 0
    assert "gpu_check on cpu (dry run)" in proc.stdout and "token_budget" in proc.stdout
    # Then one optimizer step against TRL (lit_grpo's side alone where trl is not importable).
    assert "train step vs TRL's GRPOTrainer" in proc.stdout
    (case,) = report["train_step"]["cases"]
    lit = case["runs"]["lit"][0]
    assert lit["status"] == "ok" and lit["gradient_checkpointing"] and lit["step_s"] > 0
    assert lit["padding_free"] and lit["padding"] == 0  # packed: ragged completions and no padding
