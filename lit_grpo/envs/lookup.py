"""The lookup game as an environment (`lit_grpo.envs.api`), played by the generic environment
rollout (`rollout.factory: lit_grpo.envs.lookup:make_rollout_fn`).

One call plays one row of `lit_grpo.tasks.lookup`: the row's `queries` query turns, each a
one-token move answered by the environment (`reply`), then a one-token answer turn, rewarded by
the run's reward (`task=lookup`: 1.0 for the right digit). Moves are one token by design (the
game's keys and values are single characters), whatever `sampler.max_completion_tokens` says.

With `rollout.extras.score_turns` (default true) the sample reports its turns for
`advantage=igpo`: `turn_spans` (each move's token) and `turn_rewards`, the information
gain of each turn, IG_t = s_t - s_{t-1} with s_t = mean log p(answer | prefix_t) under the
sampler's policy (`sampler.score`, temperature 1). Every prefix ends at the answer cue (`>`), so
the T + 1 scores ask the same question, "your answer now?": prefix_0 is the prompt, prefix_t
(t < T) ends with turn t's reply, each with its final cue made the answer cue, and prefix_T is the
whole trajectory plus the answer cue (the last turn's IG is what the formula gives;
`advantage.params.skip_last_ig=true` leaves it out). The T + 1 pairs go to the
sampler in one `score` call (`LookupEnvironment.finish`), batched with the other rollouts'.
`score_turns: false` skips the scoring and reports no turns (plain GRPO on the same game).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

from lit_grpo.advantages.igpo import information_gains_from_logprobs
from lit_grpo.envs.api import Episode, StepResult, Turn
from lit_grpo.envs.rollout import make_env_rollout_fn
from lit_grpo.rewards import reward_scorer
from lit_grpo.rollouts.rollout import RolloutFn, text_prompt_tokens
from lit_grpo.tasks.lookup import ANSWER_CUE, reply
from lit_grpo.types import RolloutSetup

MOVE_TOKENS = 1
"""Every move is one token: the game's keys and values are single characters."""
MAX_TURNS = 64
"""A bound far above any row's `queries` + 1: the environment ends each episode itself."""


class LookupEnvironment:
    """One row of the lookup game: `queries` query turns, each answered by `reply`, then the
    answer turn, scored by the run's reward. Texts are tokenized apart from their final cue, so
    that each history can be scored with the answer cue in place of its own."""

    def __init__(self, setup: RolloutSetup, score_turns: bool = True) -> None:
        self.sampler, self.tokenizer, self.score_turns = setup.sampler, setup.tokenizer, score_turns
        self.scorer = reward_scorer(setup.extras)
        self.encode = _encoder(setup.tokenizer)
        self.cue_lengths: list[int] = []
        """The token count of each text's final cue: the prompt's, then each reply's."""
        self.moves: list[str] = []

    async def reset(self, row: dict) -> list[int]:
        self.row, self.queries = row, int(row["queries"])
        cue = self.encode(row["prompt"][-1])
        self.cue_lengths.append(len(cue))
        return text_prompt_tokens(self.tokenizer, row["prompt"][:-1]) + list(cue)

    async def step(self, turn: Turn) -> StepResult:
        self.moves.append(turn.text)
        if turn.index < self.queries:
            text = reply(self.row, turn.text, self.queries - turn.index - 1)
            cue = self.encode(text[-1])
            self.cue_lengths.append(len(cue))
            return StepResult(reply=[*self.encode(text[:-1]), *cue])
        result = await self.scorer.score(turn.text, self.row)
        metrics = dict(result.metrics)
        if self.queries:  # was the first query a key, the target (the informative move)?
            metrics["lookup/queried_key"] = float(self.moves[0] in self.row["table"])
            metrics["lookup/queried_target"] = float(self.moves[0] == self.row["target"])
        return StepResult(reward=result.value, done=True, metrics=metrics, finish_reason="stop")

    async def finish(self, episode: Episode) -> Optional[list[float]]:
        """Each turn's information gain: the answer's mean logprob after each history (the prompt,
        then each reply), each ending at the answer cue, and after the whole trajectory."""
        if not self.score_turns:
            return None
        answer, cue = list(self.encode(self.row["answer"])), list(self.encode(ANSWER_CUE))
        # The history before turn t ends where turn t's span starts, less the cue it ended with.
        ends = [start - length for (start, _), length in zip(episode.turn_spans, self.cue_lengths)]
        prefixes = [episode.tokens[:end] + cue for end in ends] + [episode.tokens + cue]
        return information_gains_from_logprobs(await self.sampler.score([(p, answer) for p in prefixes]))


@functools.lru_cache(maxsize=8)
def _encoder(tokenizer):
    @functools.lru_cache(maxsize=4096)  # a handful of distinct texts (prompts, replies, answers)
    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    return encode


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    """The lookup game through `lit_grpo.envs.rollout.make_env_rollout_fn`; `setup.extras`: the
    run's reward (`reward_scorer`), `score_turns` (default true)."""
    score_turns = bool(setup.extras.get("score_turns", True))
    extras = {
        **setup.extras,
        "environment": functools.partial(LookupEnvironment, setup, score_turns),
        "turn_tokens": MOVE_TOKENS,
        "max_turns": MAX_TURNS,
        "report_turns": score_turns,
    }
    return make_env_rollout_fn(dataclasses.replace(setup, extras=extras))
