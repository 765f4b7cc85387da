"""The environment API (`lit_grpo.envs.api`) and its generic rollout (`lit_grpo.envs.rollout`): tool
calls parsed from a turn, and a scripted 3-turn episode checked token by token (the prompt and the
environment's replies masked out, each turn's tokens, logprobs and span in place, the reward the sum
of the turns' parts), the limits on turns, tokens and seconds, and a parse error's penalty."""

from __future__ import annotations

import asyncio
import inspect
import logging
import math

import pytest

from lit_grpo.envs.api import Environment, StepResult, ToolCall, Turn, parse_tool_calls
from lit_grpo.envs.checks import EnvironmentReturnError
from lit_grpo.envs.rollout import make_env_rollout_fn
from lit_grpo.errors import UserError
from lit_grpo.models.load import build_char_tokenizer
from lit_grpo.rollouts.deadlines import classify
from lit_grpo.samplers.stops import find_stop
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
        match = find_stop(tokens, kwargs.get("stop") or (), self.tokenizer.decode)
        if match is not None:  # as every sampler ends at a stop string: its token kept, the text cut before it
            tokens, logprobs = tokens[: match.num_tokens], logprobs[: match.num_tokens]
            self.generated -= len(logprobs) - match.num_tokens
            return [Completion([*prompt, *tokens], len(prompt), logprobs, "stop", match.text, stop_reason=match.stop)]
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
def test_a_turn_ended_by_the_stop_string_closing_its_call_calls_the_tool(tokenizer):
    """`stop: ["</tool_call>"]`: the sampler cuts the turn's text before the stop string (its token
    kept, trained on); the call is still read whole, and what the policy would have written after
    it is never generated."""
    call = '<tool_call>{"name": "add", "arguments": {"a": 5, "b": 7}}</tool_call>'
    rollout, _, environments = _rollout(tokenizer, [call + " and more", "12"], stop=["</tool_call>"])
    sample = asyncio.run(rollout({"prompt": "5+7=?"}))
    [env] = environments
    assert env.turns[0].tool_calls == (ToolCall("add", {"a": 5, "b": 7}),) and env.turns[0].parse_error is None
    assert env.turns[0].text == call.removesuffix("</tool_call>")
    assert sample.metrics["env/parse_error"] == 0.0 and sample.turn_rewards == [0.1, 1.0]
    prompt, call_ids, reply = (ids(tokenizer, t) for t in ("5+7=?", call, "<r>12</r>"))
    assert sample.tokens == [*prompt, *call_ids, *reply, *ids(tokenizer, "12")]


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


# --------------------------------------------------------------------------- what an environment returns


class Misbehaving:
    """An environment whose `reset`, `step` and `finish` return what it is given (`reset_to`, ...)."""

    def __init__(self, reset_to="1+1=?", step_to=None, finish_to=None) -> None:
        self.reset_to, self.step_to, self.finish_to = reset_to, step_to, finish_to

    async def reset(self, row: dict):
        return self.reset_to

    async def step(self, turn: Turn):
        return self.step_to if self.step_to is not None else StepResult(reward=1.0, done=True)

    async def finish(self, episode):
        return self.finish_to


class SyncStep(Misbehaving):
    def step(self, turn: Turn):  # a plain def: the rollout cannot await it
        return StepResult(reward=1.0, done=True)


def _where(cls, method: str) -> str:
    """`Class.method (file:line)`, as the rollout's message names it."""
    function = getattr(cls, method)
    return f"{cls.__qualname__}.{method} ({inspect.getsourcefile(function)}:{function.__code__.co_firstlineno})"


def _episode(tokenizer, make_env):
    setup = RolloutSetup(
        ScriptedSampler(tokenizer, ["2"] * 4),
        tokenizer,
        {"max_tokens": 8, "temperature": 1.0},
        {"environment": make_env},
    )
    return asyncio.run(make_env_rollout_fn(setup)({"prompt": "1+1=?"}))


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "env,method,says",
    [
        (Misbehaving(step_to={"reward": 1.0}), "step", "returned a dict {'reward': 1.0}; expected a lit_grpo.envs."),
        (Misbehaving(reset_to={"prompt": "1+1=?"}), "reset", "returned a dict {'prompt': '1+1=?'}; expected the"),
        (Misbehaving(reset_to=[]), "reset", "returned a list []; expected the episode's prompt"),
        (Misbehaving(reset_to=[5, -1]), "reset", "its item 1 is token id -1, outside the vocabulary"),
        (Misbehaving(step_to=StepResult(reply=3.14)), "step", "reply=3.14 (float); expected a str, a list of token"),
        (Misbehaving(step_to=StepResult(reply=[10**6])), "step", "its item 0 is token id 1000000, outside the"),
        (Misbehaving(step_to=StepResult(reply=["a"])), "step", "its item 0 is a str 'a', not a token id"),
        (Misbehaving(step_to=StepResult(reward=math.nan)), "step", "reward=nan (float); expected a finite number"),
        (Misbehaving(step_to=StepResult(reward="1.0")), "step", "reward='1.0' (str); expected a finite number"),
        (Misbehaving(step_to=StepResult(reward=True)), "step", "reward=True (bool); expected a finite number"),
        (Misbehaving(step_to=StepResult(done="yes")), "step", "done='yes' (str); expected True or False"),
        (Misbehaving(step_to=StepResult(metrics=["x"])), "step", "metrics=['x'] (list); expected a dict"),
        (Misbehaving(step_to=StepResult(metrics={"x": "high"})), "step", "metrics hold 'x': a str 'high'"),
        (Misbehaving(step_to=StepResult(finish_reason=3)), "step", "finish_reason=3 (int); expected a str or None"),
        (Misbehaving(finish_to=[1.0, 2.0]), "finish", "returned a list [1.0, 2.0]; expected None or a list of 1"),
        (Misbehaving(finish_to=[math.inf]), "finish", "(holding a float inf); expected None or a list of 1 finite"),
        (SyncStep(), "step", "returned a StepResult StepResult(reply="),
    ],
)  # fmt: skip
def test_a_wrong_return_is_named_as_the_environments_own(tokenizer, env, method, says):
    with pytest.raises(EnvironmentReturnError) as raised:
        _episode(tokenizer, lambda: env)
    message = str(raised.value)
    assert message.startswith(_where(type(env), method) + " ") and says in message, message
    assert "\n" not in message and "text input must be" not in message  # one line, not the tokenizer's
    if isinstance(env, SyncStep):
        assert message.endswith("not an awaitable: it must be `async def step`")
    assert classify(raised.value) == "failure"  # dropped and counted, as a raising environment; not a bug


@pytest.mark.timeout(30)
def test_an_environment_maker_that_returns_no_environment_is_named(tokenizer):
    with pytest.raises(
        EnvironmentReturnError, match=r"rollout\.extras\.environment.* returned a NoneType None; expected"
    ):
        _episode(tokenizer, lambda: None)


@pytest.mark.timeout(30)
def test_what_the_checks_accept(tokenizer):
    # numpy's bool and float (a gym-style environment's), a tuple of token ids, None metrics: all fine.
    np = pytest.importorskip("numpy")
    reply = tuple(ids(tokenizer, "ok"))
    step = StepResult(reply=reply, reward=np.float32(0.5), done=np.bool_(True), metrics={"m": None, "n": np.int64(2)})
    sample = _episode(tokenizer, lambda: Misbehaving(reset_to=ids(tokenizer, "1+1=?"), step_to=step, finish_to=(0.25,)))
    assert sample.reward == 0.5 and sample.turn_rewards == [0.25] and sample.tokens[-len(reply) :] == list(reply)


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


class WrongOnceInThirty(TwoGuesses):
    """`TwoGuesses`, but every 30th episode returns the wrong type: `step` a dict, `reset` a dict, or
    `step` a reply of 3.14, by `wrong` (importable as `test_envs_api:WrongOnceInThirty`)."""

    episodes = 0

    def __init__(self, wrong: str) -> None:
        self.wrong = wrong
        WrongOnceInThirty.episodes += 1
        self.bad = WrongOnceInThirty.episodes % 30 == 0

    async def reset(self, row: dict):
        prompt = await super().reset(row)
        return {"prompt": prompt} if self.bad and self.wrong == "reset_dict" else prompt

    async def step(self, turn: Turn):
        result = await super().step(turn)
        if self.bad and self.wrong == "step_dict":
            return {"reward": result.reward, "done": True}
        if self.bad and self.wrong == "reply_float":
            return StepResult(reply=3.14, reward=0.0)
        return result


def _train_env(tmp_path, monkeypatch, *overrides: str) -> list[dict]:
    from pathlib import Path

    from conftest import compose_config, trained_steps

    from lit_grpo.train import train

    monkeypatch.syspath_prepend(str(Path(__file__).parent))
    train(
        compose_config(
            "+experiment=arithmetic", "max_steps=3", "trainer.enable_progress_bar=false",
            "rollout.factory=lit_grpo.envs.rollout:make_env_rollout_fn", "+rollout.extras.max_turns=2", *overrides,
            output_dir=tmp_path,
        )
    )  # fmt: skip
    return trained_steps(tmp_path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("wrong,method", [("step_dict", "step"), ("reset_dict", "reset"), ("reply_float", "step")])
def test_an_environment_that_sometimes_returns_the_wrong_type_trains_on(tmp_path, monkeypatch, caplog, wrong, method):
    # The bad episodes are dropped and counted as an environment that raises is, with one warning
    # naming the environment's own method; the run trains to its end.
    with caplog.at_level(logging.WARNING, logger="lit_grpo"):
        steps = _train_env(
            tmp_path, monkeypatch, "+rollout.extras.environment=test_envs_api:WrongOnceInThirty",
            f"+rollout.extras.environment_kwargs.wrong={wrong}",
        )  # fmt: skip
    assert len(steps) == 3
    assert sum(step["rollout/failures"] for step in steps) >= 1
    warnings = [r.getMessage() for r in caplog.records if "rollout/failures" in r.getMessage()]
    assert len(warnings) == 1, warnings
    expected = {
        "step_dict": "returned a dict {",
        "reset_dict": "returned a dict {'prompt'",
        "reply_float": "reply=3.14",
    }
    assert _where(WrongOnceInThirty, method) in warnings[0]
    assert expected[wrong] in warnings[0] and "expected " in warnings[0]
    assert not any("text input must be" in r.getMessage() for r in caplog.records)  # not the tokenizer's words


class AlwaysWrong(TwoGuesses):
    async def step(self, turn: Turn):
        return {"reward": 1.0}


@pytest.mark.timeout(300)
def test_an_environment_that_always_returns_the_wrong_type_trips_the_breaker(tmp_path, monkeypatch):
    from lit_grpo.rollouts import RolloutCircuitOpen

    with pytest.raises(RolloutCircuitOpen) as stopped:
        _train_env(tmp_path, monkeypatch, "+rollout.extras.environment=test_envs_api:AlwaysWrong")
    assert _where(AlwaysWrong, "step") in str(stopped.value) and "returned a dict" in str(stopped.value)
