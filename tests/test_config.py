"""Every shipped config composes, and bad configs fail early with the field named; a user's loss
and task are usable from the command line alone; valid names come from the registries."""

import dataclasses
import sys
from dataclasses import dataclass

import pytest
import torch
from conftest import compose_config
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from torch.testing import assert_close

import lit_grpo.maths.loss_registry
import lit_grpo.samplers
import lit_grpo.tasks.registry
from lit_grpo.config import ConfigError, TrainConfig, ineffective_knobs
from lit_grpo.maths.losses import available_policy_losses, get_policy_loss, policy_loss
from lit_grpo.run.checkpoint import STATE_DEFINING_FIELDS
from lit_grpo.run.validate import validate
from lit_grpo.tasks import available_tasks, build_eval_rows, build_rows, get_task, register_task, reward_fn
from lit_grpo.train import CONF_DIR

GROUPS = ["model", "sampler", "task", "data", "reward", "policy_loss", "trainer", "callbacks", "logger"]
# The `user` options of `policy_loss` and `task` leave `name` to the command line.
USER_NAMES = {("policy_loss", "user"): "policy_loss.name=reinforce", ("task", "user"): "task.name=arithmetic"}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


@pytest.mark.parametrize("group,option", [(g, o) for g in GROUPS for o in _options(g)])
def test_every_group_option_composes_and_validates(group, option, tmp_path):
    overrides = [f"{group}={option}"]
    if (group, option) == ("model", "hf"):
        overrides.append("model.name_or_path=some/model")
    if (group, option) == ("sampler", "vllm"):
        overrides.append("model.num_heads=2")  # vLLM's CPU attention needs a head size >= 32
    if (group, option) in USER_NAMES:
        overrides.append(USER_NAMES[group, option])
    cfg = compose_config(*overrides, output_dir=tmp_path)
    assert isinstance(validate(cfg), TrainConfig)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml")))
def test_every_experiment_composes_and_validates(experiment, tmp_path):
    c = validate(compose_config(f"+experiment={experiment}", output_dir=tmp_path))
    assert c.output_dir == str(tmp_path)


def test_policy_loss_files_match_the_registry():
    # Every built-in loss has its file (other tests register losses of their own, without one).
    built_in = {n for n in available_policy_losses() if get_policy_loss(n).fn.__module__.startswith("lit_grpo.")}
    assert set(_options("policy_loss")) - {"user"} == built_in


def test_task_files_match_the_registry_and_mirror_each_options_dataclass():
    assert set(_options("task")) - {"user"} == set(available_tasks())
    for name in available_tasks():
        yaml = OmegaConf.to_container(OmegaConf.load(CONF_DIR / "task" / f"{name}.yaml"))
        assert yaml.pop("name") == name
        assert set(yaml) == {f.name for f in dataclasses.fields(get_task(name).options)}, name


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
        ("++policy_loss.params.dro_beta=0.1", "policy_loss.params.dro_beta"),
        ("++policy_loss.params.sapo_tau_pos=2.0", "policy_loss.params.sapo_tau_pos"),  # grpo takes no sapo temperature
        ("policy_loss=sapo policy_loss.params.sapo_tau_neg=0", "policy_loss.params.sapo_tau_neg"),
        ("policy_loss=dppo policy_loss.params.dppo_divergence=js", "policy_loss.params.dppo_divergence"),
        (
            "policy_loss=dppo policy_loss.params.dppo_divergence=kl policy_loss.params.dppo_kl_threshold=-0.1",
            "dppo_kl_threshold",
        ),
        ("policy_loss=dppo policy_loss.params.dppo_ratio_cap=inf", "policy_loss.params.dppo_ratio_cap"),
        ("policy_loss=vespo policy_loss.params.vespo_lambda_neg=0", "policy_loss.params.vespo_lambda_neg"),
        ("policy_loss=vespo policy_loss.params.vespo_k_pos=-1", "policy_loss.params.vespo_k_pos"),
        ("policy_loss=luspo policy_loss.params.eps_clip_high=-0.1", "policy_loss.params.eps_clip_high"),
        ("policy_loss=dapo policy_loss.params.eps_clip_c=0.5", "policy_loss.params.eps_clip_c"),
        ("policy_loss=grpo policy_loss.params.eps_clip=-0.1", "policy_loss.params.eps_clip"),
        ("policy_loss.loss_normalization=mean", "policy_loss.loss_normalization"),
        ("policy_loss.name=no_such_module:mine", "policy_loss.name"),
        ("task.max_answer=-1", "task.max_answer"),
        ("task=gsm8k task.on_error=ignore", "task.on_error"),
        ("task=gsm8k task.path=train.jsonl data.eval_rows=5", "task.eval_path"),
        ("batching.ppo_minibatches=1000", "batching.ppo_minibatches"),
        ("offpolicy.weight_sync_interval=3", "offpolicy.weight_sync_interval"),
        ("rollout.max_concurrency=4", "rollout.max_concurrency"),
        ("optim.lr_decay=cosine", "optim.lr_decay"),
        ("rollout.factory=no_colon", "rollout.factory"),
        ("data.min_group_size=9", "data.min_group_size"),
        ("sampler=vllm", "model.num_heads"),
        ("checkpoint.save_interval=3 offpolicy.max_lag=1 offpolicy.weight_sync_interval=2", "checkpoint.save_interval"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last"),
        ("learning_rate=nan", "learning_rate"),
        ("learning_rate=inf", "learning_rate"),
        ("learning_rate=3", "learning_rate"),
        ("optim.adam_eps=inf", "optim.adam_eps"),
        ("optim.weight_decay=nan", "optim.weight_decay"),
        ("optim.grad_clip_norm=inf", "optim.grad_clip_norm"),
        ("policy_loss.kl_beta=inf", "policy_loss.kl_beta"),
        ("policy_loss.kl_beta=nan", "policy_loss.kl_beta"),
        ("policy_loss.params.eps_clip=nan", "policy_loss.params.eps_clip"),
        ("sampler.temperature=nan", "sampler.temperature"),
        ("sampler.temperature=inf", "sampler.temperature"),
        ("sampler.temperature=1000", "sampler.temperature"),
        ("guards.rollout_timeout_s=0", "guards.rollout_timeout_s"),
        ("guards.rollout_timeout_s=inf", "guards.rollout_timeout_s"),
        ("guards.rollout_max_retries=-1", "guards.rollout_max_retries"),
        ("guards.max_rows_without_progress=0", "guards.max_rows_without_progress"),
        ("guards.max_nonfinite_steps=0", "guards.max_nonfinite_steps"),
        ("trainer.strategy=fsdp2 trainer.precision=16-mixed", "trainer.precision"),
        ("batching.micro_batch_max_tokens=-1", "batching.micro_batch_max_tokens"),
        ("offpolicy.max_rollout_versions=-1", "offpolicy.max_rollout_versions"),
        (
            "offpolicy.partial_rollouts=true sampler=vllm offpolicy.synchronous=false",
            "partial_rollouts`: needs sampler",
        ),
        (
            "offpolicy.partial_rollouts=true sampler=vllm_server offpolicy.synchronous=true",
            "partial_rollouts`: needs offpolicy.synchronous",
        ),
        (
            "offpolicy.partial_rollouts=true sampler=vllm_server offpolicy.synchronous=false "
            "offpolicy.weight_sync_interval=0",
            "partial_rollouts`: needs weight syncs",
        ),
    ],
)
def test_bad_value_fails_validation_naming_the_field(override, field, tmp_path):
    cfg = compose_config(*override.split(), output_dir=tmp_path)
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        validate(cfg)


def test_the_run_guards_have_documented_defaults(tmp_path):
    c = validate(compose_config(output_dir=tmp_path))
    g = c.guards
    assert (g.rollout_timeout_s, g.rollout_max_retries, g.max_rows_without_progress, g.max_nonfinite_steps) == (
        None,  # 300 s plus 0.5 s per completion token
        2,
        None,  # 10 steps' worth of rows, data.prompt_groups_per_step x 10, and at least 100
        3,
    )
    assert g.rollout_deadline_s(c.sampler.max_completion_tokens) == 300.0 + 0.5 * c.sampler.max_completion_tokens
    assert g.rollout_deadline_s(128) == 364.0
    assert g.rows_without_progress(c.data.prompt_groups_per_step) == max(10 * c.data.prompt_groups_per_step, 100)
    c = validate(
        compose_config("sampler.temperature=1e-6", "learning_rate=1", output_dir=tmp_path)
    )  # extreme, not absurd
    assert c.sampler.temperature == 1e-6


def test_validation_happens_before_any_model_is_loaded(tmp_path, monkeypatch):
    import lit_grpo.build
    import lit_grpo.train as train_mod

    def boom(*args, **kwargs):
        raise AssertionError("a model was loaded before the config was validated")

    monkeypatch.setattr(lit_grpo.build, "load_policy", boom)
    monkeypatch.setattr(lit_grpo.build, "load_tokenizer", boom)
    with pytest.raises(ConfigError, match="sampler.temperature"):
        train_mod.train(compose_config("sampler.temperature=-1", output_dir=tmp_path))


# --------------------------------------------------------------------------- a user's policy loss


@pytest.fixture
def isolated_losses(monkeypatch):
    """The loss registry without `user_losses`' entries (another test may have imported it), restored
    after the test, with `user_losses` not yet imported."""
    registry = {k: v for k, v in lit_grpo.maths.loss_registry.POLICY_LOSSES.items() if v.fn.__module__ != "user_losses"}
    monkeypatch.setattr(lit_grpo.maths.loss_registry, "POLICY_LOSSES", registry)
    monkeypatch.delitem(sys.modules, "user_losses", raising=False)
    yield
    sys.modules.pop("user_losses", None)  # its import registered into the registry just dropped


USER_LOSS = ["policy_loss=user", "policy_loss.name=user_losses:scaled_pg"]


def test_a_user_loss_and_its_hyperparameter_come_from_the_command_line(isolated_losses, tmp_path):
    c = validate(compose_config(*USER_LOSS, "+policy_loss.params.scale=3.0", output_dir=tmp_path))
    assert c.policy_loss.hyperparams() == {"scale": 3.0, "kl_beta": 0.0}
    # user_losses.scaled_pg: L = -scale·π·A·w, w = 1 without sampler logprobs; token_mean.
    # π = [-1, -2, -4], A = 1, the last token masked out: (3·1 + 3·2) / 2 = 4.5; dL/dπ = -3/2 on
    # each masked-in token, 0 on the masked one.
    pi = torch.tensor([[-1.0, -2.0, -4.0]], requires_grad=True)
    loss, _ = policy_loss(
        c.policy_loss.name, logprobs=pi, old_logprobs=pi.detach(), advantages=torch.tensor([1.0]),
        mask=torch.tensor([[1, 1, 0]]), normalization=c.policy_loss.loss_normalization, **c.policy_loss.hyperparams(),
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, pi)
    assert_close(loss, torch.tensor(4.5))
    assert_close(grad, torch.tensor([[-1.5, -1.5, 0.0]]))


def test_a_misspelt_loss_hyperparameter_is_refused_naming_it(isolated_losses, tmp_path):
    with pytest.raises(ConfigError, match=r"policy_loss\.params\.scael.*valid hyper-parameters.*scale"):
        validate(compose_config(*USER_LOSS, "+policy_loss.params.scael=3.0", output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"policy_loss\.params\.kl_beta.*set it as policy_loss\.kl_beta"):
        validate(compose_config("+policy_loss.params.kl_beta=0.1", output_dir=tmp_path))


def test_a_user_loss_module_is_imported_from_the_working_directory(isolated_losses, tmp_path, monkeypatch):
    (tmp_path / "my_cwd_losses.py").write_text(
        "from lit_grpo.maths.losses import register_policy_loss\n"
        "@register_policy_loss('halved', uses_tis=False, factor=0.5)\n"
        "def halved(*, logprobs, old_logprobs, advantages, mask, factor):\n"
        "    return -factor * logprobs * advantages, {}\n"
    )
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_cwd_losses", raising=False)
    c = validate(compose_config("policy_loss=user", "policy_loss.name=my_cwd_losses:halved", output_dir=tmp_path))
    assert "halved" in available_policy_losses()
    assert c.policy_loss.hyperparams() == {"kl_beta": 0.0}  # `factor` keeps its registered default
    with pytest.raises(ConfigError, match=r"policy_loss\.name.*my_cwd_losses.*registers none.*halved"):
        validate(compose_config("policy_loss=user", "policy_loss.name=my_cwd_losses:doubled", output_dir=tmp_path))


# --------------------------------------------------------------------------- tasks


def test_the_task_options_are_checked_strictly_naming_the_key(tmp_path):
    with pytest.raises(ConfigCompositionException, match="num_rowz"):  # not in conf/task/arithmetic.yaml
        compose_config("task.num_rowz=3", output_dir=tmp_path)
    with pytest.raises(ConfigError, match=r"task\.num_rowz.*valid: num_rows, max_operand, max_answer, operators"):
        validate(compose_config("+task.num_rowz=3", output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"task\.num_rows.*'many'"):
        validate(compose_config("task.num_rows=many", output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"task\.path.*arithmetic"):  # a gsm8k option on the arithmetic task
        validate(compose_config("+task.path=train.jsonl", output_dir=tmp_path))
    unknown = r"task\.name.*unknown task 'countdown'; valid: arithmetic, calculator, chat_sums, gsm8k"
    with pytest.raises(ConfigError, match=unknown):
        validate(compose_config("task.name=countdown", output_dir=tmp_path))


def test_the_task_group_sets_the_rows(tmp_path):
    c = validate(
        compose_config(
            "task.num_rows=16", "task.operators=*", "data.max_rows=10", "data.eval_rows=3", output_dir=tmp_path
        )
    )
    rows = build_rows(c)
    assert len(rows) == 10 and all("*" in r["prompt"] for r in rows)
    assert len(build_eval_rows(c)) == 3
    row = rows[0]
    assert reward_fn(c)(row["answer"], row) == 1.0 and reward_fn(c)("x", row) == 0.0


@dataclass
class _EchoOptions:
    """Options of the test's echo task."""

    word: str = "hi"
    """The word every prompt asks to repeat."""
    repeats: int = 1
    """How many times."""


def test_a_user_task_is_a_registry_entry_with_its_own_options(tmp_path, monkeypatch):
    monkeypatch.setattr(lit_grpo.tasks.registry, "TASKS", dict(lit_grpo.tasks.registry.TASKS))
    register_task(
        "echo", options=_EchoOptions,
        rows=lambda o, *, seed, max_rows: [{"prompt": f"say {o.word}", "answer": o.word * o.repeats}] * 4,
        eval_rows=lambda o, *, seed, count: [], reward=lambda o: (lambda text, row: float(text == row["answer"])),
    )  # fmt: skip
    c = validate(compose_config("task=user", "task.name=echo", "+task.repeats=2", output_dir=tmp_path))
    assert build_rows(c)[0] == {"prompt": "say hi", "answer": "hihi"}
    with pytest.raises(ConfigError, match=r"task\.repeats.*could not be converted"):
        validate(compose_config("task=user", "task.name=echo", "+task.repeats=twice", output_dir=tmp_path))
    with pytest.raises(ConfigError, match=r"task\.name.*valid: arithmetic, calculator, chat_sums, echo, gsm8k"):
        validate(compose_config("task=user", "task.name=ech", output_dir=tmp_path))


# --------------------------------------------------------------------------- registries, state, knobs


def test_sampler_kinds_come_from_the_registry(tmp_path, monkeypatch):
    monkeypatch.setattr(lit_grpo.samplers, "SAMPLERS", dict(lit_grpo.samplers.SAMPLERS))
    lit_grpo.samplers.register_sampler("scripted")(lambda cfg, weights, tokenizer, **kw: None)
    assert validate(compose_config("sampler.kind=scripted", output_dir=tmp_path)).sampler.kind == "scripted"
    with pytest.raises(ConfigError, match=r"sampler\.kind.*valid: hf, scripted, vllm"):
        validate(compose_config("sampler.kind=vlm", output_dir=tmp_path))


def test_the_state_defining_fields_are_the_marked_ones():
    assert set(STATE_DEFINING_FIELDS) == {
        "model", "seed", "policy_loss.name", "task", "data.completions_per_prompt", "data.prompt_groups_per_step",
        "data.max_rows", "data.shuffle", "data.path", "data.split", "data.dataset_config", "batching.ppo_minibatches",
        "reference.sync_every",
        "curriculum.kind",
    }  # fmt: skip


def test_synchronous_training_may_sync_every_n_steps(tmp_path):
    with pytest.raises(ConfigError, match="weight_sync_interval.*off-policy"):
        validate(compose_config("offpolicy.synchronous=false", "offpolicy.weight_sync_interval=3", output_dir=tmp_path))
    c = validate(compose_config("offpolicy.synchronous=true", "offpolicy.weight_sync_interval=3", output_dir=tmp_path))
    assert c.offpolicy.weight_sync_interval == 3


def test_ineffective_knobs_are_named(tmp_path):
    assert ineffective_knobs(validate(compose_config(output_dir=tmp_path))) == []
    assert ineffective_knobs(validate(compose_config("+experiment=arithmetic", output_dir=tmp_path))) == []
    c = validate(
        compose_config("offpolicy.synchronous=true", "offpolicy.max_lag=2", "eval_interval=5", output_dir=tmp_path)
    )
    knobs = ineffective_knobs(c)
    assert len(knobs) == 2
    assert "offpolicy.max_lag=2" in knobs[0] and "offpolicy.synchronous=true" in knobs[0]
    assert "eval_interval=5" in knobs[1] and "data.eval_rows=0" in knobs[1]
    knobs = ineffective_knobs(validate(compose_config("offpolicy.max_rollout_versions=3", output_dir=tmp_path)))
    assert (
        len(knobs) == 1
        and "offpolicy.max_rollout_versions=3" in knobs[0]
        and "offpolicy.partial_rollouts=false" in knobs[0]
    )
