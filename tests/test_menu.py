"""The algorithm menu's sweep: one `+menu=<choice>` option per new choice (`lit_grpo/conf/menu/`),
each changing the config it is composed onto, and one Hydra multirun over all of them that runs
every choice for a `fast_dev_run` step on CPU and writes the sweep table."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config
from omegaconf import OmegaConf

from lit_grpo.run.validate import validate

REPO = Path(__file__).parents[1]
MENU = sorted(p.stem for p in (REPO / "lit_grpo" / "conf" / "menu").glob("*.yaml"))
EVERY_NEW_CHOICE = {
    "adv_dr_grpo", "adv_rloo", "adv_batch_std", "adv_reinforce_pp", "adv_passk", "adv_gdpo",
    "correction_none", "correction_mask", "correction_icepop", "correction_geo_mask", "correction_kl_reject",
    "off_policy_mask", "entropy_bonus", "entropy_decay", "entropy_adaptive", "entropy_top_quantile", "entropy_alarm",
    "mask_truncated", "overlong_penalty", "loss_sapo", "loss_gmpo", "loss_dppo_tv", "loss_dppo_kl", "anchor_rollout",
}  # fmt: skip


def _flat(cfg) -> dict:
    def walk(node, prefix=""):
        for key, value in node.items():
            if isinstance(value, dict):
                yield from walk(value, f"{prefix}{key}.")
            else:
                yield f"{prefix}{key}", value

    return dict(walk(OmegaConf.to_container(cfg, resolve=False)))


def test_the_menu_has_every_new_choice():
    assert set(MENU) == EVERY_NEW_CHOICE


@pytest.mark.parametrize("choice", MENU)
def test_each_choice_changes_the_config_and_validates(choice):
    base = _flat(compose_config("+experiment=arithmetic"))
    menu_cfg = compose_config("+experiment=arithmetic", f"+menu={choice}")
    changed = {k for k, v in _flat(menu_cfg).items() if base.get(k) != v}
    assert changed, f"+menu={choice} changes nothing"
    validate(menu_cfg)


@pytest.mark.timeout(900)
def test_one_multirun_runs_every_choice_and_writes_the_sweep_table(tmp_path):
    proc = subprocess.run(
        [
            sys.executable, "-m", "lit_grpo.train", "-m", "+experiment=arithmetic", "+menu=glob(*)",
            "trainer.fast_dev_run=true", "trainer.enable_progress_bar=false", f"hydra.sweep.dir={tmp_path}",
        ],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=840,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = (tmp_path / "sweep_summary.csv").read_text().splitlines()
    assert rows[0].startswith("overrides,final_reward")
    swept = {
        word.split("=", 1)[1] for row in rows[1:] for word in row.split(",")[0].split() if word.startswith("+menu=")
    }
    assert swept == EVERY_NEW_CHOICE and len(rows) == 1 + len(EVERY_NEW_CHOICE)
    for row in rows[1:]:
        steps = float(row.split(",")[rows[0].split(",").index("steps")])
        assert steps == 1.0, row
    assert "Sweep summary" in proc.stdout
