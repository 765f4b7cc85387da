"""The environment API (`lit_grpo.envs.api`) and its generic rollout (`lit_grpo.envs.rollout`): tool
calls parsed from a turn, and a scripted 3-turn episode checked token by token (the prompt and the
environment's replies masked out, each turn's tokens, logprobs and span in place, the reward the sum
of the turns' parts), the limits on turns, tokens and seconds, and a parse error's penalty."""

from __future__ import annotations

import asyncio

import pytest

from lit_grpo.envs.api import Environment, StepResult, ToolCall, Turn, parse_tool_calls
from lit_grpo.envs.rollout import make_env_rollout_fn
from lit_grpo.errors import UserError
from lit_grpo.models.load import build_char_tokenizer
from lit_grpo.types import Completion, RolloutSetup


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer("printable")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class ScriptedSampler:
    """Answers each request with the next scripted text (cut to `max_tokens` tokens); every
    generated token's logprob is −(its position in the episode's generated tokens + 1) / 10, so a
    misplaced logprob is seen."""

    group_requests = False

    def __init__(self, tokenizer, turns: list[str], delay_s: float = 0.0) -> None:
        self.tokenizer, self.turns, self.delay_s = tokenizer, list(turns), delay_s
        self.calls: list[dict] = []
        self.generated = 0

    async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
        self.calls.append(kwargs)
        await asyncio.sleep(self.delay_s)
        text = self.turns[len(self.calls) - 1]
        tokens = ids(self.tokenizer, text)[: kwargs["max_tokens"]]
        logprobs = [-(self.generated + i + 1) / 10 for i in range(len(tokens))]
        self.generated += len(tokens)
        reason = "length" if len(tokens) < len(ids(self.tokenizer, text)) else "stop"
        return [Completion([*prompt, *tokens], len(prompt), logprobs, reason, self.tokenizer.decode(tokens))]


class Calculator:
    """A scripted tool environment: `add` tool calls are answered with the sum; a plain answer
    ends the episode, 1.0 if it is the row's answer. Each tool turn earns 0.1."""

    def __init__(self) -> None:
        self.turns: list[Turn] = []

    async def reset(self, row: dict) -> str:
        return row["prompt"]

    async def step(self, turn: Turn) -> StepResult:
        self.turns.append(turn)
        if turn.tool_calls:
            total = sum(call.arguments["a"] + call.arguments["b"] for call in turn.tool_calls if call.name == "add")
            return StepResult(reply=f"<r>{total}</r>", reward=0.1, metrics={"calc/used": 1.0})
        return StepResult(reward=float(turn.text.strip() == "12"), done=True)


def _rollout(tokenizer, turns, *, delay_s=0.0, **extras):
    sampler = ScriptedSampler(tokenizer, turns, delay_s)
    environments: list[Calculator] = []

    def new_env() -> Calculator:
        environments.append(Calculator())
        return environments[-1]

    setup = RolloutSetup(
        sampler, tokenizer, {"max_tokens": 128, "temperature": 1.0}, {"environment": new_env, **extras}
    )
    return make_env_rollout_fn(setup), sampler, environments


def test_tool_calls_are_parsed_in_the_common_json_format():
    calls, error = parse_tool_calls(
        'x <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
        '<tool_call>{"name": "noop"}</tool_call> y <tool_call>{"name":"f","arguments":"{\\"k\\": 3}"}</tool_call>'
    )
    assert error is None
    assert calls == (ToolCall("add", {"a": 1, "b": 2}), ToolCall("noop", {}), ToolCall("f", {"k": 3}))
    assert parse_tool_calls("no call here") == ((), None)
    for bad, why in (
        ("<tool_call>{not json}</tool_call>", "not JSON"),
        ('<tool_call>{"arguments": {}}</tool_call>', "no string 'name'"),
        ('<tool_call>{"name": "f", "arguments": [1]}</tool_call>', "not an object"),
        ('<tool_call>{"name": "f"}', "not closed"),
    ):
        calls, error = parse_tool_calls(bad)
        assert calls == () and why in error, (bad, error)


def test_the_calculator_is_an_environment():
    assert isinstance(Calculator(), Environment)


@pytest.mark.timeout(30)
def test_a_scripted_three_turn_episode_token_by_token(tokenizer):
    call = '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 7}}</tool_call>'
    turns = [call, call, "12"]
    rollout, sampler, environments = _rollout(tokenizer, turns)
    sample = asyncio.run(rollout({"prompt": "5+7=?"}))
    [env] = environments
    prompt, reply, call_ids, answer = (ids(tokenizer, t) for t in ("5+7=?", "<r>12</r>", call, "12"))
    # tokens: prompt | call | reply | call | reply | "12"; mask 1 on the three turns only.
    expected = [*prompt, *call_ids, *reply, *call_ids, *reply, *answer]
    assert sample.tokens == expected
    starts = [len(prompt), len(prompt) + len(call_ids) + len(reply), len(expected) - len(answer)]
    ends = [starts[0] + len(call_ids), starts[1] + len(call_ids), len(expected)]
    assert sample.turn_spans == list(zip(starts, ends))
    mask = [0] * len(expected)
    for start, end in sample.turn_spans:
        mask[start:end] = [1] * (end - start)
    assert sample.loss_mask == mask
    # Each generated token carries its own logprob, in episode order; 0.0 elsewhere.
    generated = [i for i, m in enumerate(mask) if m]
    assert [sample.logprobs[i] for i in generated] == [-(k + 1) / 10 for k in range(len(generated))]
    assert all(sample.logprobs[i] == 0.0 for i, m in enumerate(mask) if not m)
    # Reward: 0.1 + 0.1 + 1.0, each part the turn's reward.
    assert sample.turn_rewards == [0.1, 0.1, 1.0] and sample.reward == pytest.approx(1.2)
    assert [t.tool_calls for t in env.turns] == [(ToolCall("add", {"a": 5, "b": 7}),)] * 2 + [()]
    assert [t.index for t in env.turns] == [0, 1, 2]
    assert sample.metrics["env/turns"] == 3.0 and sample.metrics["env/tool_calls"] == 2.0
    assert sample.metrics["calc/used"] == 1.0 and "env/limit_turns" not in sample.metrics
    # Each request saw the whole episode so far as its prompt.
    assert len(sampler.calls) == 3


@pytest.mark.timeout(30)
def test_limits_end_an_episode_that_runs_on(tokenizer):
    call = '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>'
    rollout, _, _ = _rollout(tokenizer, [call] * 10, max_turns=2)
    sample = asyncio.run(rollout({"prompt": "1+1=?"}))
    assert sample.metrics["env/limit_turns"] == 1.0 and len(sample.turn_spans) == 2
    # A token budget of one call and 4 tokens: the first call fits, the second gets the 4 left and
    # is cut to "<too", which holds no tool call: a (wrong) plain answer, which ends the episode.
    n = len(ids(tokenizer, call))
    rollout, sampler, _ = _rollout(tokenizer, [call] * 10, max_tokens=n + 4)
    sample = asyncio.run(rollout({"prompt": "1+1=?"}))
    assert [c["max_tokens"] for c in sampler.calls] == [n + 4, 4]
    assert sum(sample.loss_mask) == n + 4 and sample.finish_reason == "length"
    assert sample.turn_rewards == [0.1, 0.0] and sample.metrics["env/parse_error"] == 0.0
    # A budget of exactly two calls: both are played whole, then the budget ends the episode.
    rollout, sampler, _ = _rollout(tokenizer, [call] * 10, max_tokens=2 * n)
    sample = asyncio.run(rollout({"prompt": "1+1=?"}))
    assert len(sampler.calls) == 2 and sample.turn_rewards == [0.1, 0.1]
    assert sample.metrics["env/limit_tokens"] == 1.0 and sample.metrics["env/parse_error"] == 0.0
    # A slow sampler past max_seconds: the episode ends with what it has.
    rollout, _, _ = _rollout(tokenizer, [call] * 10, delay_s=0.2, max_seconds=0.5)
    sample = asyncio.run(rollout({"prompt": "1+1=?"}))
    assert sample.metrics["env/limit_seconds"] == 1.0 and 1 <= len(sample.turn_spans) <= 3


@pytest.mark.timeout(30)
def test_a_parse_error_is_a_penalty_not_a_crash(tokenizer):
    rollout, _, environments = _rollout(tokenizer, ["<tool_call>{oops}</tool_call>"], parse_error_penalty=-0.5)
    sample = asyncio.run(rollout({"prompt": "1+1=?"}))
    assert sample.reward == -0.5 and sample.turn_rewards == [-0.5]
    assert sample.metrics["env/parse_error"] == 1.0 and environments[0].turns == []  # never reached the env


def test_bad_extras_are_named(tokenizer):
    with pytest.raises(UserError, match=r"rollout\.extras\.environment"):
        make_env_rollout_fn(RolloutSetup(ScriptedSampler(tokenizer, []), tokenizer, {"max_tokens": 4}, {}))
    with pytest.raises(UserError, match=r"rollout\.extras\.max_turns"):
        _rollout(tokenizer, [], max_turns=0)
    with pytest.raises(UserError, match=r"rollout\.extras\.environment.*cannot import"):
        make_env_rollout_fn(
            RolloutSetup(ScriptedSampler(tokenizer, []), tokenizer, {"max_tokens": 4}, {"environment": "nope:Env"})
        )


# --------------------------------------------------------------------------- in a training run


class TwoGuesses:
    """The demo's sums as an environment: a right first answer earns 1 and ends; a wrong one gets
    the reply "-" and a second guess worth 0.5 (importable as `test_envs_api:TwoGuesses`)."""

    async def reset(self, row: dict) -> str:
        self.answer = row["answer"]
        return row["prompt"]

    async def step(self, turn: Turn) -> StepResult:
        right = turn.text.strip() == self.answer
        if turn.index == 0 and not right:
            return StepResult(reply="-", reward=0.0, metrics={"guess/second": 1.0})
        return StepResult(reward=(1.0 if turn.index == 0 else 0.5) * right, done=True)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("advantage", ["grpo", "igpo"])
def test_an_environment_trains_through_the_generic_rollout(tmp_path, monkeypatch, advantage):
    # IGPO credits each turn with the environment's reward part: any environment gets turn credit.
    from pathlib import Path

    from conftest import compose_config, trained_steps

    from lit_grpo.train import train

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    train(
        compose_config(
            "+experiment=arithmetic", "max_steps=3", "trainer.enable_progress_bar=false", f"advantage={advantage}",
            "rollout.factory=lit_grpo.envs.rollout:make_env_rollout_fn",
            "+rollout.extras.environment=test_envs_api:TwoGuesses", "+rollout.extras.max_turns=2",
            output_dir=tmp_path,
        )
    )  # fmt: skip
    steps = trained_steps(tmp_path)
    assert len(steps) == 3
    for step in steps:
        assert 1.0 <= step["env/turns"] <= 2.0 and step["env/tool_calls"] == 0.0
        assert 0.0 <= step["reward/mean"] <= 1.0
    assert any(step["env/turns"] > 1.0 for step in steps)  # second guesses were played and trained
