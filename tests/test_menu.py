"""The algorithm menu's sweep: one `+menu=<choice>` option per new choice (`lit_grpo/conf/menu/`),
each changing the config it is composed onto, and one Hydra multirun over all of them that runs
every choice for a `fast_dev_run` step on CPU and writes the sweep table. Then the families
composed: every advantage estimator with every length control and every correction either trains
a step or is refused at config time naming both fields (`lit_grpo.run.validate.check_advantage_inputs`)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import compose_config
from omegaconf import OmegaConf

from lit_grpo.advantages.registry import ADVANTAGES
from lit_grpo.config import ConfigError
from lit_grpo.maths.correction import CORRECTIONS
from lit_grpo.run.validate import validate
from lit_grpo.train import train

REPO = Path(__file__).parents[1]
MENU = sorted(p.stem for p in (REPO / "lit_grpo" / "conf" / "menu").glob("*.yaml"))
EVERY_NEW_CHOICE = {
    "adv_dr_grpo", "adv_rloo", "adv_batch_std", "adv_reinforce_pp", "adv_passk", "adv_gdpo",
    "correction_none", "correction_mask", "correction_icepop", "correction_geo_mask", "correction_kl_reject",
    "off_policy_mask", "entropy_bonus", "entropy_decay", "entropy_adaptive", "entropy_top_quantile", "entropy_alarm",
    "mask_truncated", "overlong_penalty", "loss_sapo", "loss_gmpo", "loss_dppo_tv", "loss_dppo_kl", "anchor_rollout",
    "loss_luspo", "loss_vespo",
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


@pytest.mark.slow
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


# ------------------------------------------------------------------- the families composed

ESTIMATORS = ("grpo", "dr_grpo", "rloo", "batch_std", "reinforce_pp", "passk", "gdpo", "igpo")
LENGTH_CONTROLS = {"none": (), "mask_truncated": ("+menu=mask_truncated",), "overlong": ("+menu=overlong_penalty",)}
MODES = ("none", "tis", "mask", "icepop", "geo_mask", "kl_reject")
# What cannot work, each refused before a model loads: (estimator, length control, experiment) ->
# the two fields the one-line error names (any correction). igpo credits the turns a multi-turn
# rollout reports, so it runs on its own game; on the arithmetic demo's single-turn rollout it is refused.
REFUSED = {
    ("passk", "overlong", "arithmetic"): (r"rollout\.overlong_buffer_len", r"advantage\.name=passk"),
    **{("igpo", control, "arithmetic"): (r"rollout\.factory", r"advantage\.name=igpo") for control in LENGTH_CONTROLS},
}


def test_the_composition_covers_every_built_in_family_member():
    built_in = {name for name, spec in ADVANTAGES.items() if spec.fn.__module__.startswith("lit_grpo.")}
    assert set(ESTIMATORS) == built_in
    assert set(MODES) == {name for name, spec in CORRECTIONS.items() if spec.fn.__module__.startswith("lit_grpo.")}


def _composed(estimator, control, experiment, mode, tmp_path):
    return compose_config(
        f"+experiment={experiment}", f"advantage={estimator}", f"correction={mode}", *LENGTH_CONTROLS[control],
        "trainer.fast_dev_run=true", "trainer.enable_progress_bar=false", "logger=none", output_dir=tmp_path,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("control", LENGTH_CONTROLS)
@pytest.mark.parametrize(
    ("estimator", "experiment"), [*((e, "arithmetic") for e in ESTIMATORS), ("igpo", "igpo_lookup")]
)
def test_every_estimator_length_control_and_correction_trains_or_is_refused(
    estimator, experiment, control, mode, tmp_path
):
    cfg = _composed(estimator, control, experiment, mode, tmp_path)
    if (estimator, control, experiment) in REFUSED:
        first, second = REFUSED[estimator, control, experiment]
        with pytest.raises(ConfigError, match=rf"{first}.*{second}"):
            validate(cfg)
    else:
        assert train(cfg)["steps"] == 1


@pytest.mark.parametrize(
    ("overrides", "first", "second"),
    [
        (["advantage=passk", "+menu=overlong_penalty"], r"rollout\.overlong_buffer_len", r"advantage\.name=passk"),
        (["advantage=passk", "reward.timeout_reward=0.5"], r"reward\.timeout_reward", r"advantage\.name=passk"),
        (["advantage=passk", "reward.weights=[0.5]"], r"reward\.weights", r"advantage\.name=passk"),
        (
            ["advantage=gdpo", "+menu=overlong_penalty", "reward.fn=[arithmetic,exact_match]"],
            r"rollout\.overlong_buffer_len", r"advantage\.name=gdpo.*arithmetic, exact_match",
        ),
        (["advantage=igpo"], r"rollout\.factory", r"advantage\.name=igpo"),
    ],
)  # fmt: skip
def test_what_cannot_work_is_refused_naming_both_fields(overrides, first, second, tmp_path):
    with pytest.raises(ConfigError, match=rf"^config field `{first}`: [^\n]*{second}[^\n]*$"):
        validate(compose_config("+experiment=arithmetic", *overrides, output_dir=tmp_path))


def test_what_can_work_is_not_refused(tmp_path):
    # A penalty factor of 0 adds nothing; gdpo with one reward reads the penalized reward itself.
    for overrides in (
        ["advantage=passk", "+menu=overlong_penalty", "rollout.overlong_penalty_factor=0"],
        ["advantage=passk", "reward.timeout_reward=1", "reward.weights=[1.0]"],
        ["advantage=gdpo", "+menu=overlong_penalty"],
    ):
        validate(compose_config("+experiment=arithmetic", *overrides, output_dir=tmp_path))


@pytest.mark.timeout(120)
def test_a_refused_combination_exits_2_with_one_line_from_the_cli(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", "+experiment=arithmetic", "advantage=passk", "+menu=overlong_penalty",
         f"output_dir={tmp_path / 'run'}"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=110,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "rollout.overlong_buffer_len" in line]
    assert len(errors) == 1 and "advantage.name=passk" in errors[0], proc.stderr[-2000:]
