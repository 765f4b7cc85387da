"""Rewards as plug-ins: the registry (built-ins and `module:function`), the `reward` config group
checked at config time, and weighted components, each logged as `reward/<name>`."""

from __future__ import annotations

import asyncio
import csv
import math
import sys

import pytest
from conftest import compose_config

from lit_grpo.config import ConfigError, RewardConfig
from lit_grpo.rewards import (
    RewardRowError,
    WeightedReward,
    available_rewards,
    build_reward,
    get_reward,
    register_reward,
    reward_name,
)
from lit_grpo.rollouts import GroupSampler, RowCursor, SynchronousScheduler, rollout_metrics
from lit_grpo.rollouts.datamodule import RolloutStream
from lit_grpo.rollouts.rollout import make_rollout_fn
from lit_grpo.run.validate import check_reward, validate
from lit_grpo.tasks import reward_fn
from lit_grpo.types import Completion, RolloutSetup

USER_REWARDS = '''
def brevity(completion_text, row):
    """1 for a completion of at most 2 characters."""
    return 1.0 if len(completion_text) <= 2 else 0.0


def only_tagged(completion_text, row):
    return 1.0 if "tag" in row else None


def needs_three(completion_text, row, extra):
    return 0.0


NOT_A_FUNCTION = 3
'''


@pytest.fixture
def user_rewards(tmp_path, monkeypatch):
    """A module `my_rewards` (USER_REWARDS) in the working directory, as a user would have it."""
    (tmp_path / "my_rewards.py").write_text(USER_REWARDS)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    yield tmp_path
    sys.modules.pop("my_rewards", None)


# --------------------------------------------------------------------------- the registry


def test_the_built_ins_are_registered_and_the_tasks_use_them(tmp_path):
    assert {"arithmetic", "gsm8k", "exact_match"} <= set(available_rewards())
    assert reward_fn(validate(compose_config(output_dir=tmp_path))) is get_reward("arithmetic")  # one implementation
    assert reward_fn(validate(compose_config("task=gsm8k", output_dir=tmp_path))) is get_reward("gsm8k")
    arithmetic, exact = get_reward("arithmetic"), get_reward("exact_match")
    assert arithmetic("7 is it", {"answer": "7"}) == 1.0 and arithmetic("71", {"answer": "7"}) == 0.0
    assert exact(" 7\n", {"answer": 7}) == 1.0 and exact("7 is it", {"answer": "7"}) == 0.0
    with pytest.raises(
        RewardRowError, match=r"'exact_match': the row has no reference answer \(field 'answer'\); its fields: prompt"
    ):
        exact("7", {"prompt": "3+4="})


def test_a_registered_name_in_a_users_module(user_rewards, monkeypatch):
    import lit_grpo.rewards.registry as registry

    monkeypatch.setattr(registry, "REWARDS", dict(registry.REWARDS))
    (user_rewards / "my_registered.py").write_text(
        "from lit_grpo.rewards import register_reward\n"
        "@register_reward('shouty')\n"
        "def _shouty(completion_text, row):\n"
        "    return float(completion_text.isupper())\n"
    )
    monkeypatch.delitem(sys.modules, "my_registered", raising=False)
    fn = get_reward("my_registered:shouty")
    assert fn("YES", {}) == 1.0 and get_reward("shouty") is fn and reward_name("my_registered:shouty") == "shouty"
    with pytest.raises(ValueError, match="already registered"):
        register_reward("shouty")(lambda text, row: 0.0)


def test_config_errors_name_the_field(user_rewards, tmp_path):
    cases = [
        (["reward.fn=nonexistent_mod:f"], r"reward\.fn.*no module 'nonexistent_mod'"),
        (["reward.fn=my_rewards:brevty"], r"reward\.fn.*has no 'brevty'; did you mean 'brevity'"),
        (["reward.fn=my_rewards:NOT_A_FUNCTION"], r"reward\.fn.*'my_rewards:NOT_A_FUNCTION' is a int, not a function"),
        (["reward.fn=my_rewards:needs_three"], r"reward\.fn.*must take \(completion_text, row\)"),
        (
            ["reward.fn=exact_matsh"],
            r"reward\.fn.*unknown reward 'exact_matsh'; registered: arithmetic, exact_match, gsm8k",
        ),
        (
            ["reward.fn=[arithmetic,my_rewards:brevity]", "reward.weights=[1.0]"],
            r"reward\.weights.*1 weight for 2 reward components",
        ),
        (["reward.weights=[1.0,2.0]"], r"reward\.weights.*2 weights for 1 reward component"),  # the task's reward alone
        (["reward.fn=[arithmetic,exact_match]", "reward.weights=[1.0,nan]"], r"reward\.weights.*finite"),
        (["reward.fn=[]"], r"reward\.fn.*at least one"),
        (["reward.fn=[exact_match,exact_match]"], r"reward\.fn.*share a name"),
    ]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=message):
            validate(compose_config(*overrides, output_dir=tmp_path))
    (user_rewards / "my_mean.py").write_text("def mean(completion_text, row):\n    return 0.0\n")
    with pytest.raises(ConfigError, match=r"reward\.fn.*may not be called 'mean': reward/mean is already logged"):
        check_reward(RewardConfig(fn=["exact_match", "my_mean:mean"]))  # the registry's checks run in validate
    sys.modules.pop("my_mean", None)


# --------------------------------------------------------------------------- weighted components


def test_a_weighted_sum_skips_none_and_reports_each_component(user_rewards):
    c = RewardConfig(fn=["exact_match", "my_rewards:brevity", "my_rewards:only_tagged"], weights=[1.0, 0.5, 2.0])
    reward = build_reward(c, lambda: pytest.fail("the task's reward is not used"), "arithmetic")
    assert [name for name, _ in reward.components] == ["exact_match", "brevity", "only_tagged"]
    total, parts = reward.score("7", {"answer": "7"})  # only_tagged: None, skipped
    assert total == 1.5 and parts == {"reward/exact_match": 1.0, "reward/brevity": 1.0}
    total, parts = reward.score("long answer", {"answer": "7", "tag": 1})
    assert total == 2.0 and parts == {"reward/exact_match": 0.0, "reward/brevity": 0.0, "reward/only_tagged": 1.0}
    assert reward("7", {"answer": "7"}) == 1.5  # callable like any reward (custom rollouts, evaluation)
    alone = WeightedReward([("only_tagged", get_reward("my_rewards:only_tagged"))], [3.0])
    assert alone.score("x", {}) == (None, {}) and alone.score("x", {"tag": 1}) == (3.0, {})  # one component: no parts
    with pytest.raises(TypeError, match=r"reward 'bad' returned str 'yes', not a number or None"):
        WeightedReward([("bad", lambda t, r: "yes"), ("ok", lambda t, r: 1.0)], [1.0, 1.0]).score("x", {})
    task_weighted = build_reward(RewardConfig(weights=[2.0]), lambda: get_reward("arithmetic"), "arithmetic")
    assert task_weighted.score("7", {"answer": "7"}) == (2.0, {})
    assert build_reward(RewardConfig(), lambda: get_reward("gsm8k"), "gsm8k") is get_reward("gsm8k")


class _Scripted:
    """A sampler answering the texts of `texts` in turn."""

    group_requests = False  # one request per sample, as a sampler that is not a BatchingSampler declares

    def __init__(self, texts: list[str]) -> None:
        self.texts, self.i = texts, 0

    async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
        text = self.texts[self.i % len(self.texts)]
        self.i += 1
        return [
            Completion(
                full_tokens=[*prompt, 20],
                prompt_len=len(prompt),
                sampling_logprobs=[-0.5],
                finish_reason="stop",
                text=text,
            )
        ]


def _rollout(tokenizer, reward, texts):
    return make_rollout_fn(RolloutSetup(_Scripted(texts), tokenizer, {"max_tokens": 1}, {"reward_fn": reward}))


def test_the_default_rollout_puts_components_in_metrics_and_drops_all_none(tokenizer, user_rewards):
    reward = build_reward(
        RewardConfig(fn=["exact_match", "my_rewards:only_tagged"], weights=[1.0, 0.5]), lambda: None, "x"
    )
    rollout = _rollout(tokenizer, reward, ["7"])
    sample = asyncio.run(rollout({"prompt": "3+4=", "answer": "7", "tag": True}))
    # Every sample also says whether a component missed its deadline (`reward/timed_out`) and how
    # often its reward was retried (`reward/retries`).
    both = {"reward/exact_match": 1.0, "reward/only_tagged": 1.0, "reward/timed_out": 0.0, "reward/retries": 0.0}
    assert sample.reward == 1.5 and sample.metrics == both
    one = {"reward/exact_match": 1.0, "reward/timed_out": 0.0, "reward/retries": 0.0}
    assert asyncio.run(rollout({"prompt": "3+4=", "answer": "7"})).metrics == one
    none_only = build_reward(RewardConfig(fn=["my_rewards:only_tagged", "my_rewards:brevity"]), lambda: None, "x")
    none_only.components[1] = ("brevity", lambda text, row: None)
    assert asyncio.run(_rollout(tokenizer, none_only, ["7"])({"prompt": "3+4="})) is None  # every component: None


@pytest.mark.timeout(120)
def test_a_step_logs_each_component_and_counts_the_dropped(tokenizer, user_rewards):
    reward = build_reward(RewardConfig(fn=["exact_match", "my_rewards:only_tagged"]), lambda: None, "x")
    none_for_untagged = WeightedReward(
        [
            ("exact_match", lambda t, r: 1.0 if "tag" in r and t == r["answer"] else (0.0 if "tag" in r else None)),
            ("only_tagged", get_reward("my_rewards:only_tagged")),
        ],
        [1.0, 1.0],
    )
    rows = [
        {"prompt": "1+1=", "answer": "2", "tag": 1},
        {"prompt": "2+2=", "answer": "4"},
        {"prompt": "3+3=", "answer": "6", "tag": 1},
    ]
    for fn, dropped in ((reward, 0), (none_for_untagged, 3)):
        groups = GroupSampler(_rollout(tokenizer, fn, ["2", "x", "6"]), 3, max_seq_len=64, min_group_size=2, filters=[])
        scheduler = SynchronousScheduler(RowCursor(rows, 1, 0, shuffle=False), groups, 2, max_concurrency=256)
        batch = next(iter(RolloutStream(scheduler, groups, max_steps=1, pad_id=0)))
        metrics = rollout_metrics([batch.record])
        assert metrics.get("rollout/dropped_none", 0) == dropped
        assert 0.0 <= metrics["reward/exact_match"] <= 1.0 and metrics["reward/only_tagged"] == 1.0
        assert math.isclose(metrics["reward/mean"], sum(batch.record.rewards) / len(batch.record.rewards))


@pytest.mark.timeout(300)
def test_a_weighted_run_logs_one_curve_per_component(tmp_path, user_rewards):
    from lit_grpo.train import train

    summary = train(
        compose_config(
            "+experiment=arithmetic",
            "max_steps=3",
            "optim.lr_decay=constant",
            "reward.fn=[arithmetic,my_rewards:brevity]",
            "reward.weights=[1.0,0.25]",
            "trainer.enable_progress_bar=false",
            "~callbacks.reward_filter",
            "output_model_id=null",
            output_dir=tmp_path / "run",
        )
    )
    assert summary["steps"] == 3
    rows = list(csv.DictReader((tmp_path / "run" / "metrics.csv").open()))
    logged = [r for r in rows if r.get("reward/mean")]
    assert len(logged) == 3
    for r in logged:  # the sum's mean is the weighted sum of the components' means (every sample has both)
        assert float(r["reward/mean"]) == pytest.approx(
            float(r["reward/arithmetic"]) + 0.25 * float(r["reward/brevity"])
        )
        assert float(r["reward/brevity"]) == 1.0  # one-token completions are short
