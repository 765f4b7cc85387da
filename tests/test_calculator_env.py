"""The calculator tool environment (`lit_grpo.envs.calculator`, rows of `lit_grpo.tasks.calculator`):
the rows and the calculator, scripted episodes checked token by token (the call assembled across
moves and read back by `parse_tool_calls`, the tool's response, the answer scored, only the
policy's moves trained on), the response computed from the call and not from the row, a malformed
call's penalty, and the experiment end to end."""

from __future__ import annotations

import asyncio
import random

import pytest

from lit_grpo.envs.api import ToolCall, parse_tool_calls
from lit_grpo.envs.calculator import make_rollout_fn
from lit_grpo.errors import UserError
from lit_grpo.models.load import build_char_tokenizer
from lit_grpo.tasks import get_task
from lit_grpo.tasks.calculator import (
    CALL_HEAD,
    CalculatorOptions,
    answer_reward,
    calculate,
    held_out_rows,
    make_row,
    make_rows,
    tool_call,
    tool_response,
)
from lit_grpo.types import Completion, RolloutSetup


@pytest.fixture(scope="module")
def tokenizer():
    return build_char_tokenizer("calculator")


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


class PolicySampler:
    """Plays the moves `policy(episode_text) -> str` says, one token each; every generated token's
    logprob is -(its index among the episode's moves + 1) / 10, so a misplaced one is seen."""

    group_requests = False

    def __init__(self, tokenizer, policy) -> None:
        self.tokenizer, self.policy = tokenizer, policy
        self.moves = 0

    async def sample_with_prompt_tokens(self, prompt, n=1, **kwargs):
        assert kwargs["max_tokens"] == 1  # every move is one token
        tokens = ids(self.tokenizer, self.policy(self.tokenizer.decode(prompt)))[:1]
        self.moves += 1
        logprobs = [-self.moves / 10] * len(tokens)
        return [Completion([*prompt, *tokens], len(prompt), logprobs, "stop", self.tokenizer.decode(tokens))]


def scripted(moves: list[str]):
    """A policy that plays `moves` in order, whatever it sees."""
    it = iter(moves)
    return lambda text: next(it)


def _rollout(tokenizer, policy, **extras):
    sampler = PolicySampler(tokenizer, policy)
    setup = RolloutSetup(
        sampler, tokenizer, {"max_tokens": 1, "temperature": 1.0}, {"reward_fn": answer_reward, **extras}
    )
    return make_rollout_fn(setup)


def _play(tokenizer, row, policy, **extras):
    return asyncio.run(_rollout(tokenizer, policy, **extras)(row))


ROW = {"prompt": "(37+48)%7?", "expression": "(37+48)%7", "answer": "1", "shown": False}


@pytest.mark.timeout(10)
def test_rows_and_the_calculator():
    opts = CalculatorOptions(num_rows=400)
    rows = make_rows(opts, seed=3)
    assert rows == make_rows(opts, seed=3)  # seeded
    for row in rows:
        a, b = int(row["expression"][1:3]), int(row["expression"][4:6])
        assert 10 <= a <= 99 and 10 <= b <= 99 and row["expression"] == f"({a}+{b})%7"
        assert row["answer"] == str((a + b) % 7) == str(calculate(row["expression"]))
        shown = tool_call(row["expression"]) + tool_response(row["answer"]) if row["shown"] else ""
        assert row["prompt"] == f"{row['expression']}?{shown}"
    assert 150 < sum(r["shown"] for r in rows) < 250  # shown_frac 0.5
    assert len({r["answer"] for r in rows}) == 7 and max(rows.count(r) for r in rows) < 10
    assert not any(r["shown"] for r in held_out_rows(opts, seed=3, count=50))
    products = make_row(random.Random(0), CalculatorOptions(operators="*", modulus=10))
    assert "*" in products["expression"] and products["answer"] == str(calculate(products["expression"]))
    # The call the environment writes is one JSON tool call, read back by the API's parser.
    assert parse_tool_calls(tool_call("(1+2)%7")) == ((ToolCall("calc", {"expression": "(1+2)%7"}),), None)
    assert calculate("(1+2)*-3") == -9 and calculate("7//2") == 3 and calculate("17%5") == 2
    for bad in ("x", "3/2", "2**8", "1/0", "1%0", "open('f')", "", "1e3", "9" * 13 + "*1"):
        assert calculate(bad) is None, bad
    assert get_task("calculator").reward(CalculatorOptions()) is answer_reward
    assert answer_reward(" 1", ROW) == 1.0 and answer_reward("2", ROW) == 0.0 and answer_reward("", ROW) == 0.0


@pytest.mark.timeout(30)
def test_a_tool_call_episode_token_by_token(tokenizer):
    sample = _play(tokenizer, ROW, scripted(["<", "1"]))
    prompt, call, answer = ids(tokenizer, ROW["prompt"]), ids(tokenizer, "<"), ids(tokenizer, "1")
    rest = ids(tokenizer, tool_call(ROW["expression"])[1:] + tool_response("1"))
    # prompt | `<` (policy) | the rest of the call and the response (environment) | `1` (policy)
    assert sample.tokens == [*prompt, *call, *rest, *answer]
    assert sample.loss_mask == [0] * len(prompt) + [1] + [0] * len(rest) + [1]
    assert [sample.logprobs[i] for i, m in enumerate(sample.loss_mask) if m] == [-0.1, -0.2]
    assert all(lp == 0.0 for lp, m in zip(sample.logprobs, sample.loss_mask) if not m)
    text = tokenizer.decode(sample.tokens)
    assert text == f"{ROW['prompt']}{tool_call(ROW['expression'])}\n1" + "1"
    assert parse_tool_calls(text)[0] == (ToolCall("calc", {"expression": "(37+48)%7"}),)
    assert sample.reward == 1.0 and sample.turn_spans is None  # a plain sample for GRPO by default
    assert sample.metrics["env/tool_calls"] == 1.0 and sample.metrics["env/turns"] == 2.0
    assert sample.metrics["calc/called"] == 1.0 and sample.metrics["calc/solved"] == 1.0
    assert sample.metrics["env/parse_error"] == 0.0 and "calc/shown_solved" not in sample.metrics


@pytest.mark.timeout(30)
def test_a_direct_answer_and_a_shown_row(tokenizer):
    for move, reward in (("1", 1.0), ("4", 0.0), ("?", 0.0)):
        sample = _play(tokenizer, ROW, scripted([move]))
        assert sample.reward == reward and sum(sample.loss_mask) == 1 and sample.loss_mask[-1] == 1
        assert sample.metrics["env/tool_calls"] == 0.0 and sample.metrics["calc/called"] == 0.0
        assert sample.metrics["calc/solved"] == reward
    shown = {**ROW, "prompt": ROW["prompt"] + tool_call(ROW["expression"]) + tool_response("1"), "shown": True}
    sample = _play(tokenizer, shown, scripted(["<"]))  # no decision on a shown row: `<` is a wrong answer
    assert sample.reward == 0.0 and sample.metrics["calc/shown_solved"] == 0.0 and "calc/called" not in sample.metrics
    assert _play(tokenizer, shown, scripted(["1"])).metrics["calc/shown_solved"] == 1.0


def repeat_after_calling(text: str) -> str:
    """Call the tool at the decision cue, then repeat the last character (the tool's value)."""
    return "<" if text.endswith("?") else text[-1]


@pytest.mark.timeout(60)
def test_the_answer_comes_from_the_tool(tokenizer):
    # Calling and repeating the response solves every row; answering blind with one digit is chance.
    rows = make_rows(CalculatorOptions(num_rows=100, shown_frac=0.0), seed=0)
    rollout = _rollout(tokenizer, repeat_after_calling)
    rewards = [asyncio.run(rollout(row)).reward for row in rows]
    assert rewards == [1.0] * len(rows)
    blind = [asyncio.run(_rollout(tokenizer, scripted(["3"]))(row)).reward for row in rows]
    assert 0.03 < sum(blind) / len(rows) < 0.35
    # The response is the value of the call's own expression: a policy that writes a wrong one is
    # answered with that expression's value, and repeating it is wrong.
    moves = ["<", *"(30+40)%7", '"', "0"]
    sample = _play(tokenizer, ROW, scripted(moves), write_expression=True)
    assert tokenizer.decode(sample.tokens).endswith(tool_call("(30+40)%7") + "\n0" + "0")
    assert sample.reward == 0.0 and sample.metrics["env/tool_calls"] == 1.0
    assert sum(sample.loss_mask) == len(moves)  # every character of the expression is the policy's
    sample = _play(tokenizer, ROW, scripted(["<", *"(37+48)%7", '"', "1"]), write_expression=True)
    assert sample.reward == 1.0 and sample.metrics["calc/solved"] == 1.0
    sample = _play(tokenizer, ROW, scripted(["<", *"ex", '"', "e"]), write_expression=True)
    assert tokenizer.decode(sample.tokens).endswith("\nerror" + "e") and sample.reward == 0.0


@pytest.mark.timeout(30)
def test_a_malformed_call_is_the_penalty_not_a_crash(tokenizer):
    # A newline inside the expression's JSON string: the call does not parse.
    sample = _play(tokenizer, ROW, scripted(["<", "1", "\n", '"']), write_expression=True, parse_error_penalty=-0.5)
    assert sample.reward == -0.5 and sample.metrics["env/parse_error"] == 1.0
    assert sample.metrics["env/tool_calls"] == 0.0 and sample.metrics["calc/called"] == 0.0
    assert tokenizer.decode(sample.tokens).endswith(CALL_HEAD + "1\n" + '"')  # no response was given
    # A call never closed: the penalty once the expression reaches max_expression_chars.
    sample = _play(tokenizer, ROW, scripted(["<", *"1" * 10]), write_expression=True, max_expression_chars=4)
    assert sample.reward == -1.0 and sample.metrics["env/parse_error"] == 1.0 and sum(sample.loss_mask) == 5


def test_bad_extras_are_named(tokenizer):
    for key, value in (("write_expression", "yes"), ("max_expression_chars", 0), ("parse_error_penalty", "x")):
        with pytest.raises(UserError, match=rf"rollout\.extras\.{key}"):
            _rollout(tokenizer, scripted([]), **{key: value})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_experiment_trains(tmp_path):
    from conftest import compose_config, trained_steps

    from lit_grpo.train import train

    train(
        compose_config(
            "+experiment=calculator_tool", "max_steps=4", "trainer.enable_progress_bar=false", output_dir=tmp_path
        )
    )
    steps = trained_steps(tmp_path)
    assert len(steps) == 4
    for step in steps:
        assert 0.0 <= step["reward/mean"] <= 1.0 and 1.0 <= step["env/turns"] <= 2.0
        assert 0.0 <= step["calc/called"] <= 1.0 and step["env/parse_error"] == 0.0
        assert "calc/shown_solved" in step and "calc/solved" in step  # both kinds of rows were played
