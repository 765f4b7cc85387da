"""Knobs a config sets that have no effect in it, or not the one they promise: one warning each at
start-up (`ineffective_knobs`)."""

from __future__ import annotations

from dataclasses import fields

from lit_grpo.config.controls import EntropyConfig
from lit_grpo.config.curriculum import CurriculumConfig
from lit_grpo.config.groups import DataConfig, RewardConfig
from lit_grpo.config.run import TrainConfig
from lit_grpo.config.sources import source_kind
from lit_grpo.config.training import CheckpointConfig


def ineffective_knobs(c: TrainConfig) -> list[str]:
    """One message per knob that this config sets but that has no effect in it (logged at start-up).

    A knob at its default is not reported: only values someone chose and that do nothing.
    """
    knobs = []
    o = c.offpolicy
    if o.synchronous and o.max_lag > 0:
        knobs.append(
            f"offpolicy.max_lag={o.max_lag} has no effect with offpolicy.synchronous=true: "
            "every rollout is drained before each step, so none is ever off-policy"
        )
    if o.max_rollout_versions > 0 and not o.partial_rollouts:
        knobs.append(
            f"offpolicy.max_rollout_versions={o.max_rollout_versions} has no effect with "
            "offpolicy.partial_rollouts=false: no sampler reports its tokens' versions"
        )
    if c.eval_interval > 0 and c.data.eval_rows == 0:
        knobs.append(
            f"eval_interval={c.eval_interval} has no effect with data.eval_rows=0: there is nothing to evaluate"
        )
    if c.data.eval_path and c.data.eval_rows == 0:
        knobs.append(f"data.eval_path={c.data.eval_path} has no effect with data.eval_rows=0: nothing is evaluated")
    data_defaults = {f.name: f.default for f in fields(DataConfig)}
    if not any(p and source_kind(p) == "dataset" for p in (c.data.path, c.data.eval_path)):
        for name in ("split", "eval_split", "dataset_config"):
            if getattr(c.data, name) != data_defaults[name]:
                knobs.append(
                    f"data.{name}={getattr(c.data, name)} has no effect: "
                    "neither data.path nor data.eval_path is a dataset"
                )
    if c.rollout.overlong_buffer_len == 0 and c.rollout.overlong_penalty_factor != 1.0:
        knobs.append(
            f"rollout.overlong_penalty_factor={c.rollout.overlong_penalty_factor} has no effect with "
            "rollout.overlong_buffer_len=0: the overlong penalty is off"
        )
    budget = c.batching.micro_batch_max_tokens
    if 0 < budget < c.data.max_seq_len:  # not without effect, but not the bound it says
        knobs.append(
            f"batching.micro_batch_max_tokens={budget} is below data.max_seq_len={c.data.max_seq_len}: "
            "a sequence longer than the budget cannot be split and goes through a forward of its own, over it "
            "(counted in train/micro_batches_over_budget); set it to at least data.max_seq_len to bound every forward"
        )
    knobs += _ineffective_entropy_knobs(c.entropy)
    if not c.reference.moves and c.reference.mix_alpha != 1.0:
        knobs.append(
            f"reference.mix_alpha={c.reference.mix_alpha} has no effect with reference.sync_every=0: "
            "the reference stays frozen"
        )
    knobs += _ineffective_reward_model_knobs(c.reward)
    knobs += _ineffective_curriculum_knobs(c.curriculum)
    if c.checkpoint.save_interval == 0 and c.checkpoint.keep_last != CheckpointConfig().keep_last:
        knobs.append(
            f"checkpoint.keep_last={c.checkpoint.keep_last} has no effect with checkpoint.save_interval=0: "
            "no checkpoint is saved"
        )
    return knobs


def _ineffective_entropy_knobs(e: EntropyConfig) -> list[str]:
    defaults = EntropyConfig()
    knobs = []
    if (e.coef_final is None) != (e.decay_steps == 0):
        set_ = f"coef_final={e.coef_final}" if e.coef_final is not None else f"decay_steps={e.decay_steps}"
        knobs.append(f"entropy.{set_} has no effect alone: a decay needs entropy.coef_final and decay_steps > 0")
    if not e.adaptive:
        for name in ("adapt_step", "coef_max"):
            if getattr(e, name) != getattr(defaults, name):
                value = getattr(e, name)
                knobs.append(f"entropy.{name}={value} has no effect without entropy.target (the adaptive bonus)")
    return knobs


def _ineffective_reward_model_knobs(r: RewardConfig) -> list[str]:
    defaults, knobs = RewardConfig(), []
    local, served = ("model_device", "model_dtype"), ("model_api_key_env", "model_request_timeout_s")
    for names, applies, why in (
        (("model_batch_size", "model_linger_s", *local, *served), r.model is None, "without reward.model"),
        (local, r.model_url is not None, "with reward.model_url: the server runs the reward model"),
        (served, r.model is not None and r.model_url is None, "without reward.model_url: it runs in process"),
    ):
        for name in names if applies else ():
            if getattr(r, name) != getattr(defaults, name):
                knobs.append(f"reward.{name}={getattr(r, name)} has no effect {why}")
    return knobs


def _ineffective_curriculum_knobs(cur: CurriculumConfig) -> list[str]:
    defaults = CurriculumConfig()
    if cur.kind == "none":
        names = ["pass_reward", "pass_rate_ema", "easy_above", "hard_below", "pool_weights"]
        why = "with curriculum.kind=none: every row is drawn once per epoch"
    elif cur.kind == "fn":
        names, why = ["pool_weights"], "with curriculum.kind=fn: curriculum.fn gives the weights"
    else:
        return []
    return [
        f"curriculum.{name}={getattr(cur, name)} has no effect {why}"
        for name in names
        if getattr(cur, name) != getattr(defaults, name)
    ]
