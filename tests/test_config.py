"""Every shipped config composes, and bad configs fail early with the field named."""

from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf.errors import ConfigKeyError, ValidationError

from lit_grpo.config import ConfigError, TrainConfig, validate
from lit_grpo.losses import available_policy_losses

from conftest import CONF_DIR, compose_config

GROUPS = ["model", "sampler", "data", "policy_loss", "trainer", "callbacks", "logger"]


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes_and_validates(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if (group, option) == ("model", "hf"):
        overrides.append("model.name_or_path=some/model")
    if (group, option) == ("sampler", "vllm"):
        overrides.append("model.num_heads=2")  # vLLM's CPU attention needs a head size >= 32
    cfg = compose_config(*overrides, output_dir=tmp_path)
    assert isinstance(validate(cfg), TrainConfig)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_validates(experiment, tmp_path):
    c = validate(compose_config(f"+experiment={experiment}", output_dir=tmp_path))
    assert c.output_dir == str(tmp_path)


def test_policy_loss_files_match_the_registry():
    assert set(_options("policy_loss")) == set(available_policy_losses())


def test_misspelt_key_fails_at_compose_naming_it(tmp_path):
    with pytest.raises(ConfigCompositionException, match="learning_rat"):
        compose_config("learning_rat=0.1", output_dir=tmp_path)
    with pytest.raises(ConfigCompositionException, match="completions_per_promt"):
        compose_config("data.completions_per_promt=4", output_dir=tmp_path)


def test_wrong_type_fails_at_compose_naming_it(tmp_path):
    with pytest.raises(ConfigCompositionException, match="completions_per_prompt"):
        compose_config("data.completions_per_prompt=many", output_dir=tmp_path)


@pytest.mark.parametrize(
    "override,field",
    [
        ("data.completions_per_prompt=1", "data.completions_per_prompt"),
        ("policy_loss.kl_beta=-0.1", "policy_loss.kl_beta"),
        ("sampler.temperature=0", "sampler.temperature"),
        ("learning_rate=0", "learning_rate"),
        ("model.kind=hf", "model.name_or_path"),
        ("policy_loss.dro_beta=0.1", "dro_beta"),
        ("ppo_n_minibatches=1000", "ppo_n_minibatches"),
        ("weight_sync_interval=3", "weight_sync_interval"),
        ("max_concurrency_rollout_sample=4", "max_concurrency_rollout_sample"),
        ("lr_decay=cosine", "lr_decay"),
        ("rollout.factory=no_colon", "rollout.factory"),
        ("data.min_group_size=9", "data.min_group_size"),
        ("sampler=vllm", "model.num_heads"),
        ("dcp_save_interval=3 max_head_offpolicy_versions=1 weight_sync_interval=2", "dcp_save_interval"),
        ("dcp_keep_last=0", "dcp_keep_last"),
    ],
)
def test_bad_value_fails_validation_naming_the_field(override, field, tmp_path):
    cfg = compose_config(*override.split(), output_dir=tmp_path)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(cfg)


def test_validation_happens_before_any_model_is_loaded(tmp_path, monkeypatch):
    import lit_grpo.train as train_mod

    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(train_mod, "load_policy", boom)
    monkeypatch.setattr(train_mod, "load_tokenizer", boom)
    with pytest.raises(ConfigError, match="sampler.temperature"):
        train_mod.train(compose_config("sampler.temperature=-1", output_dir=tmp_path))
