"""The config by job: few top-level knobs, each other one in exactly one group; the old names of
the moved keys as aliases (one line each, the value reaching the new key) on the command line, in
`compose_config` and in a config built in Python; a misspelt key, or an old name in a YAML file,
as one line naming the key meant, exit code 2."""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml
from conftest import compose_config
from omegaconf import OmegaConf

from lit_grpo.config import MOVED, TrainConfig
from lit_grpo.config.keys import closest_key, known_keys
from lit_grpo.config.moved import GROUP_KEYS, MOVED_VALUES, rename_moved_keys, rename_saved
from lit_grpo.run.validate import validate

ROOT = Path(__file__).resolve().parents[1]
MAX_TOP_LEVEL_SCALARS = 12

# A value for each old key that differs from its default, and the value its new key then holds.
VALUES: dict[str, tuple[str, object]] = {
    "adam_beta1": ("0.8", 0.8), "adam_beta2": ("0.99", 0.99), "adam_eps": ("1.0e-06", 1e-6),
    "weight_decay": ("0.1", 0.1), "grad_clip_norm": ("0.5", 0.5), "warmup_steps": ("3", 3),
    "lr_decay": ("linear", "linear"), "micro_batch_size": ("2", 2), "micro_batch_max_tokens": ("64", 64),
    "ppo_n_minibatches": ("2", 2), "synchronous_training": ("true", True), "max_head_offpolicy_versions": ("2", 2),
    "weight_sync_interval": ("2", 2), "partial_rollouts": ("true", True), "max_rollout_versions": ("3", 3),
    "max_concurrency_rollout_sample": ("32", 32), "dcp_save_interval": ("4", 4), "dcp_keep_last": ("3", 3),
    "rollout_timeout_s": ("30.0", 30.0), "rollout_max_retries": ("1", 1),
    "rollout_retry_on": ("[OSError]", ["OSError"]),
    "rollout_failure_share": ("0.25", 0.25), "rollout_failure_window": ("10", 10),
    "max_rows_without_progress": ("50", 50), "max_nonfinite_steps": ("5", 5), "anchor_logp": ("rollout", "rollout"),
    "policy_loss.eps_clip": ("0.3", 0.3), "policy_loss.eps_clip_high": ("0.4", 0.4),
    "policy_loss.eps_clip_c": ("3.0", 3.0), "policy_loss.dro_beta": ("0.1", 0.1),
    "policy_loss.sapo_tau_pos": ("2.0", 2.0), "policy_loss.sapo_tau_neg": ("3.0", 3.0),
    "policy_loss.dppo_divergence": ("kl", "kl"), "policy_loss.dppo_tv_threshold": ("0.1", 0.1),
    "policy_loss.dppo_kl_threshold": ("0.02", 0.02), "policy_loss.dppo_ratio_cap": ("10.0", 10.0),
    "policy_loss.tis_cap": ("2.5", 2.5), "policy_loss.tis_level": ("sequence", "sequence"),
    "policy_loss.advantage": ("igpo", "igpo"), "policy_loss.advantage_scale": ("none", "dr_grpo"),
    "policy_loss.igpo_gamma": ("0.5", 0.5), "policy_loss.igpo_skip_last_ig": ("true", True),
}  # fmt: skip


def _new_key(old: str) -> str:
    return f"{MOVED[old]}.name" if MOVED[old] in GROUP_KEYS else MOVED[old]


def _scalars(node: dict) -> list[str]:
    return [k for k, v in node.items() if not isinstance(v, (dict, list))]


# --------------------------------------------------------------------------- the shape


def test_the_demo_shows_few_top_level_scalars():
    composed = OmegaConf.to_container(compose_config("+experiment=arithmetic"), resolve=False)
    top = _scalars(composed)
    assert len(top) <= MAX_TOP_LEVEL_SCALARS, top
    assert {"seed", "max_steps", "learning_rate", "resume", "output_dir", "output_model_id"} <= set(top)


def test_the_cli_job_config_shows_few_top_level_scalars(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", "+experiment=arithmetic", "--cfg", "job"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    job = yaml.safe_load(out.stdout)
    assert len(_scalars(job)) <= MAX_TOP_LEVEL_SCALARS and "optim" in job and "offpolicy" in job
    assert not set(job) & set(MOVED), "an old name is still a field"


JOB_GROUPS = ("optim", "batching", "offpolicy", "checkpoint", "guards")


def test_no_field_is_in_two_groups():
    """The top level and the groups by job share no field name, and each old key has one new home."""
    hints = typing.get_type_hints(TrainConfig)
    where: dict[str, list[str]] = {}
    for f in dataclasses.fields(TrainConfig):
        if not dataclasses.is_dataclass(hints[f.name]):
            where.setdefault(f.name, []).append("<top>")
    for group in JOB_GROUPS:
        for f in dataclasses.fields(hints[group]):
            where.setdefault(f.name, []).append(group)
    assert {name: places for name, places in where.items() if len(places) > 1} == {}
    targets = [new for old, new in MOVED.items() if new not in GROUP_KEYS]
    assert len(targets) == len(set(targets)), "two old keys share a new one"


def test_every_new_key_is_in_the_schema_and_no_old_one_is():
    known = set(known_keys(TrainConfig))
    for old, new in MOVED.items():
        assert old not in known, f"{old} is still a field"
        assert new.split(".params.")[0] in known, f"{new} is not a key of the schema"
    assert set(VALUES) == set(MOVED), "every alias has a test value"


# --------------------------------------------------------------------------- every alias


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_on_the_command_line_says_one_line_and_sets_the_new_key(old, caplog):
    text, expected = VALUES[old]
    with caplog.at_level(logging.WARNING, logger="lit_grpo.config.moved"):
        cfg = compose_config(f"{old}={text}")
    said = [r.getMessage() for r in caplog.records if r.name == "lit_grpo.config.moved"]
    assert len(said) == 1 and "\n" not in said[0], said
    assert said[0].startswith(old) and f" is now {MOVED[old]}" in said[0]
    assert said[0].endswith("the old name works until the next release")
    assert OmegaConf.select(cfg, _new_key(old)) == expected


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_name_in_a_python_config_says_one_line_and_sets_the_new_key(old, caplog):
    text, expected = VALUES[old]
    raw = yaml.safe_load(text) if old not in MOVED_VALUES else text
    cfg = OmegaConf.to_container(compose_config(), resolve=False)
    node = cfg
    *parents, leaf = old.split(".")
    for part in parents:
        node = node[part]
    node[leaf] = raw
    with caplog.at_level(logging.WARNING, logger="lit_grpo.config.moved"):
        renamed = rename_moved_keys(OmegaConf.create(cfg))
    said = [r.getMessage() for r in caplog.records if r.name == "lit_grpo.config.moved"]
    assert len(said) == 1 and MOVED[old] in said[0]
    assert OmegaConf.select(renamed, _new_key(old)) == expected
    assert OmegaConf.select(renamed, old) is None


def test_a_python_config_with_old_names_validates(tmp_path):
    cfg = OmegaConf.to_container(compose_config(output_dir=tmp_path), resolve=False)
    cfg.update(adam_beta1=0.8, synchronous_training=True, dcp_save_interval=2)
    cfg["policy_loss"]["eps_clip"] = 0.3
    c = validate(OmegaConf.create(cfg))
    assert (c.optim.adam_beta1, c.offpolicy.synchronous, c.checkpoint.save_interval) == (0.8, True, 2)
    assert c.policy_loss.params["eps_clip"] == 0.3


def test_a_checkpoint_saved_under_the_old_names_reads_under_the_new_ones():
    saved = {"ppo_n_minibatches": 2, "policy_loss.eps_clip": 0.2, "policy_loss.tis_cap": None, "seed": 0}
    assert rename_saved(saved) == {"batching.ppo_minibatches": 2, "policy_loss.params.eps_clip": 0.2, "seed": 0}


# --------------------------------------------------------------------------- misspelt keys


@pytest.mark.parametrize(
    "key, meant",
    [("trainer.max_step", "max_steps"), ("learning_rte", "learning_rate"), ("optim.adam_beta", "optim.adam_beta1")],
)
def test_the_key_meant_is_the_closest_by_its_last_part(key, meant):
    assert closest_key(key, known_keys(TrainConfig)) == meant


def _cli(tmp_path: Path, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "lit_grpo.train", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def test_a_misspelt_key_is_one_line_naming_the_key_meant(tmp_path):
    out = _cli(tmp_path, "+experiment=arithmetic", "trainer.max_step=3")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: config key `trainer.max_step` does not exist; did you mean `max_steps`?"
    ]


def test_an_old_name_in_a_yaml_file_is_one_line_naming_the_new_key(tmp_path):
    (tmp_path / "mine" / "experiment").mkdir(parents=True)
    (tmp_path / "mine" / "experiment" / "old.yaml").write_text("# @package _global_\nadam_beta1: 0.8\n")
    out = _cli(tmp_path, "--config-dir", str(tmp_path / "mine"), "+experiment=old")
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "error: config key `adam_beta1` is now `optim.adam_beta1`; rename it (old names work on the command "
        "line and in Python for one release, not in a YAML file)"
    ]


@pytest.mark.timeout(600)
def test_old_names_on_the_command_line_train(tmp_path):
    run_dir = tmp_path / "run"
    out = _cli(
        tmp_path, "+experiment=arithmetic", "max_steps=2", "synchronous_training=true", "grad_clip_norm=0.5",
        "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}", timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    said = [line for line in out.stderr.splitlines() if "the old name works" in line]
    assert said == [
        "synchronous_training is now offpolicy.synchronous; the old name works until the next release",
        "grad_clip_norm is now optim.grad_clip_norm; the old name works until the next release",
    ]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
    job = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert (job.optim.grad_clip_norm, job.offpolicy.synchronous) == (0.5, True)


def test_a_checkpoint_saved_under_the_old_names_resumes_and_its_state_fields_are_compared(tmp_path):
    from lit_grpo.config import ConfigError
    from lit_grpo.run.checkpoint import CONFIG_FILE, check_resumable, config_as_dict

    c = validate(compose_config(output_dir=tmp_path))
    saved = config_as_dict(c)
    batching, offpolicy = saved.pop("batching"), saved.pop("offpolicy")
    saved.update(ppo_n_minibatches=batching["ppo_minibatches"], synchronous_training=offpolicy["synchronous"])
    saved["policy_loss"]["eps_clip"] = saved["policy_loss"]["params"].pop("eps_clip")
    (tmp_path / CONFIG_FILE).write_text(OmegaConf.to_yaml(saved))
    check_resumable(tmp_path, c)  # the same run under its old names
    saved["ppo_n_minibatches"] = 2
    (tmp_path / CONFIG_FILE).write_text(OmegaConf.to_yaml(saved))
    with pytest.raises(ConfigError, match=r"batching\.ppo_minibatches: 2 in the checkpoint, 1 now"):
        check_resumable(tmp_path, c)


# --------------------------------------------------------------------------- old and new name together


@pytest.mark.parametrize(
    "overrides, key",
    [
        (["dcp_save_interval=2", "checkpoint.save_interval=3"], "checkpoint.save_interval"),
        (["checkpoint.save_interval=3", "dcp_save_interval=2"], "checkpoint.save_interval"),
        (["synchronous_training=false", "offpolicy.synchronous=true"], "offpolicy.synchronous"),
        (["policy_loss.eps_clip=0.1", "++policy_loss.params.eps_clip=0.3"], "policy_loss.params.eps_clip"),
        (["policy_loss.advantage=group", "policy_loss.advantage_scale=none"], "advantage"),
        (["advantage=dr_grpo", "policy_loss.advantage=group"], "advantage"),
    ],
)
def test_an_old_and_a_new_name_at_odds_are_refused_naming_both(overrides, key):
    from lit_grpo.config import ConfigError

    with pytest.raises(ConfigError) as refused:
        compose_config(*overrides)
    message = str(refused.value)
    assert overrides[0] in message and overrides[1] in message and f"({key})" in message


@pytest.mark.parametrize(
    "overrides, key, value",
    [
        (["dcp_save_interval=2", "checkpoint.save_interval=2"], "checkpoint.save_interval", 2),
        (["synchronous_training=False", "offpolicy.synchronous=false"], "offpolicy.synchronous", False),
        (["policy_loss.advantage=group", "policy_loss.advantage_scale=std"], "advantage.name", "grpo"),
    ],
)
def test_an_old_and_a_new_name_that_agree_pass(overrides, key, value):
    assert OmegaConf.select(compose_config(*overrides), key) == value


def test_an_old_and_a_new_name_at_odds_on_the_command_line_exit_2_in_one_line(tmp_path):
    out = _cli(tmp_path, "+experiment=arithmetic", "dcp_save_interval=2", "checkpoint.save_interval=3", timeout=120)
    assert out.returncode == 2
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: dcp_save_interval=2 and checkpoint.save_interval=3 set one key (checkpoint.save_interval) to "
        "different values: give it once, as checkpoint.save_interval"
    ]
    assert "Traceback" not in out.stderr
