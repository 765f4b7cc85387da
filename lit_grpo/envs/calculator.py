"""The calculator tool as an environment (`lit_grpo.envs.api`), played by the generic environment
rollout (`rollout.factory: lit_grpo.envs.calculator:make_rollout_fn`); rows of `task=calculator`.

The policy's moves are one token each (the tiny model's alphabet is characters), and the
environment writes what a grammar would force, as constrained decoding fills in forced tokens:

    (37+48)%7?            prompt
    <                     move 1: `<` calls the tool; anything else is the answer (scored, done)
    tool_call>{"name": "calc", "arguments": {"expression": "(37+48)%7"}}</tool_call>
                          the environment: the rest of the call (its expression the row's, or with
                          `write_expression` the policy's own, one move a character until its
                          closing `"`); the call, read back whole by
                          `lit_grpo.envs.api.parse_tool_calls`, is run by `calculate`
    \n1                   the environment: the tool's response (the value, on a line of its own)
    1                     move 2: the answer, scored by the run's reward (`task=calculator`)

The tool is a real one: its response is the value of the expression the call carries, never the
row's answer (with `write_expression` a wrong expression gets its own value, one that is not
arithmetic gets `error`). A call that does not parse (a control character inside its JSON string,
or one never closed within `max_expression_chars`) ends the episode with
`rollout.extras.parse_error_penalty` (default -1.0) as that move's reward and `env/parse_error`
= 1, as the generic rollout does for a tool call it cannot read. Rows whose prompt already shows
the call (`shown`) are answered at once.

Metrics: `env/tool_calls` (the calls run: this environment assembles each call across moves, so it
counts them itself), `calc/called` and `calc/solved` on the rows that show no call (the policy
called the tool; its answer was right), `calc/shown_solved` on the rows that do.
"""

from __future__ import annotations

import dataclasses
import functools

from lit_grpo.envs.api import StepResult, Turn, parse_tool_calls
from lit_grpo.envs.rollout import make_env_rollout_fn
from lit_grpo.errors import UserError
from lit_grpo.rewards import reward_scorer
from lit_grpo.rollouts.rollout import RolloutFn
from lit_grpo.tasks.calculator import CALL_HEAD, CALL_TAIL, TOOL, calculate, tool_response
from lit_grpo.types import RolloutSetup

CALL_MOVE = CALL_HEAD[0]
"""The move that calls the tool: the first character of `<tool_call>`."""
MOVE_TOKENS = 1
"""Every move is one token (one character of the calculator alphabet)."""
MAX_TURNS = 64
"""A bound above any episode's moves: the environment ends each episode itself."""
DEFAULT_MAX_EXPRESSION_CHARS = 16


class CalculatorEnvironment:
    """One row of `task=calculator`: a decision move, the call's expression (the row's, or the
    policy's with `write_expression`), the tool's response, the answer move."""

    def __init__(
        self,
        setup: RolloutSetup,
        write_expression: bool = False,
        max_expression_chars: int = DEFAULT_MAX_EXPRESSION_CHARS,
        parse_error_penalty: float = -1.0,
    ) -> None:
        self.scorer = reward_scorer(setup.extras)
        self.encode = _encoder(setup.tokenizer)
        self.write_expression, self.max_expression_chars = write_expression, max_expression_chars
        self.penalty = parse_error_penalty
        self.state = "decide"
        """`decide` (call or answer), `expression` (the policy writes it), `answer`."""
        self.call_text = ""
        """The call as it stands, the policy's characters and the environment's together."""
        self.metrics: dict[str, float] = {}

    async def reset(self, row: dict) -> str:
        self.row = row
        if row.get("shown"):
            self.state = "answer"
        return row["prompt"]

    async def step(self, turn: Turn) -> StepResult:
        if self.state == "decide" and turn.text == CALL_MOVE:
            if self.write_expression:
                self.state, self.call_text = "expression", CALL_HEAD
                return StepResult(reply=list(self.encode(CALL_HEAD[1:])))
            self.call_text = CALL_MOVE
            return self._run_call(CALL_HEAD[1:] + self.row["expression"] + CALL_TAIL)
        if self.state == "expression":
            self.call_text += turn.text
            if turn.text == CALL_TAIL[0]:
                return self._run_call(CALL_TAIL[1:])
            if len(self.call_text) - len(CALL_HEAD) >= self.max_expression_chars:
                return self._parse_error()
            return StepResult()
        return await self._answer(turn.text)

    def _run_call(self, rest: str) -> StepResult:
        """End the call with `rest` (what the environment writes), read it back with
        `parse_tool_calls` and answer it with the tool's response."""
        self.call_text += rest
        calls, error = parse_tool_calls(self.call_text)
        if error is not None or len(calls) != 1:
            return self._parse_error()
        (call,) = calls
        expression = call.arguments.get("expression")
        value = calculate(expression) if call.name == TOOL and isinstance(expression, str) else None
        self.state = "answer"
        self.metrics.update({"env/tool_calls": 1.0, "calc/called": 1.0})
        reply = rest + tool_response("error" if value is None else str(value))
        return StepResult(reply=list(self.encode(reply)), metrics=dict(self.metrics))

    def _parse_error(self) -> StepResult:
        metrics = {"env/parse_error": 1.0, "calc/called": 0.0, "calc/solved": 0.0}
        return StepResult(reward=self.penalty, done=True, metrics=metrics, finish_reason="stop")

    async def _answer(self, text: str) -> StepResult:
        result = await self.scorer.score(text, self.row)
        metrics = dict(result.metrics)
        if self.row.get("shown"):
            metrics["calc/shown_solved"] = float(result.value == 1.0)
        else:
            metrics["calc/called"] = self.metrics.get("calc/called", 0.0)
            metrics["calc/solved"] = float(result.value == 1.0)
        return StepResult(reward=result.value, done=True, metrics=metrics, finish_reason="stop")


@functools.lru_cache(maxsize=8)
def _encoder(tokenizer):
    @functools.lru_cache(maxsize=4096)  # a handful of distinct texts (call ends, responses)
    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    return encode


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    """The calculator through `lit_grpo.envs.rollout.make_env_rollout_fn`; `setup.extras`: the
    run's reward (`reward_scorer`), `write_expression` (default false: the environment writes the
    row's expression into the call), `max_expression_chars` (16), `parse_error_penalty` (-1.0)."""
    extras = setup.extras
    write = extras.get("write_expression", False)
    if not isinstance(write, bool):
        raise UserError(f"config field `rollout.extras.write_expression`: must be true or false, got {write!r}")
    chars = extras.get("max_expression_chars", DEFAULT_MAX_EXPRESSION_CHARS)
    if not (isinstance(chars, int) and not isinstance(chars, bool) and chars >= 1):
        raise UserError(f"config field `rollout.extras.max_expression_chars`: must be an integer >= 1, got {chars!r}")
    penalty = extras.get("parse_error_penalty", -1.0)
    if isinstance(penalty, bool) or not isinstance(penalty, (int, float)):
        raise UserError(f"config field `rollout.extras.parse_error_penalty`: must be a number, got {penalty!r}")
    environment = functools.partial(CalculatorEnvironment, setup, write, chars, float(penalty))
    extras = {
        **extras,
        "environment": environment,
        "turn_tokens": MOVE_TOKENS,
        "max_turns": MAX_TURNS,
        "report_turns": bool(extras.get("report_turns", False)),
    }
    return make_env_rollout_fn(dataclasses.replace(setup, extras=extras))
