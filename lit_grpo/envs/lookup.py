"""The lookup game's rollout (`rollout.factory: lit_grpo.envs.lookup:make_rollout_fn`).

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
sampler in one `score` call, batched with the other rollouts'. `score_turns: false` skips the
scoring (plain GRPO on the same game).
"""

from __future__ import annotations

import functools
from typing import Optional

from lit_grpo.advantages.igpo import information_gains_from_logprobs
from lit_grpo.rewards import reward_scorer
from lit_grpo.rollouts.rollout import RolloutFn, Trajectory, text_prompt_tokens
from lit_grpo.tasks.lookup import ANSWER_CUE, reply
from lit_grpo.types import RolloutSample, RolloutSetup


def make_rollout_fn(setup: RolloutSetup) -> RolloutFn:
    """The lookup game's rollout function; `setup.extras`: the run's reward (`reward_scorer`),
    `score_turns` (default true)."""
    sampler, tokenizer = setup.sampler, setup.tokenizer
    sample_kwargs = {**setup.sample_kwargs, "max_tokens": 1}  # one-token moves
    scorer = reward_scorer(setup.extras)
    score_turns = bool(setup.extras.get("score_turns", True))

    @functools.lru_cache(maxsize=4096)  # a handful of distinct texts (prompts, replies, answers)
    def encode(text: str) -> tuple[int, ...]:
        return tuple(tokenizer(text, add_special_tokens=False)["input_ids"])

    async def move(traj: Trajectory) -> str:
        """Sample one move continuing the trajectory; returns its text."""
        (c,) = await sampler.sample_with_prompt_tokens(list(traj.tokens), n=1, **sample_kwargs)
        traj.add_completion(c)
        return c.text

    async def rollout_fn(row: dict) -> Optional[RolloutSample]:
        # Texts are tokenized apart from their final cue, so that each history can be scored
        # with the answer cue in place of its own (whatever the tokenizer would merge).
        traj = Trajectory(text_prompt_tokens(tokenizer, row["prompt"][:-1]))
        history_ends = [len(traj.tokens)]  # the history before turn t + 1, without its cue
        traj.add_environment(list(encode(row["prompt"][-1])))
        moves, queries = [], int(row["queries"])
        for turn in range(queries):
            moves.append(await move(traj))
            text = reply(row, moves[-1], queries - turn - 1)
            traj.add_environment(list(encode(text[:-1])))
            history_ends.append(len(traj.tokens))
            traj.add_environment(list(encode(text[-1])))
        moves.append(await move(traj))
        result = await scorer.score(moves[-1], row)
        if result.value is None:
            return None
        gains = None
        if score_turns:
            answer, cue = list(encode(row["answer"])), list(encode(ANSWER_CUE))
            prefixes = [traj.tokens[:end] + cue for end in history_ends] + [traj.tokens + cue]
            gains = information_gains_from_logprobs(await sampler.score([(p, answer) for p in prefixes]))
        sample = traj.to_sample(
            result.value,
            text=tokenizer.decode(traj.tokens[history_ends[0] :], skip_special_tokens=True),
            turn_rewards=gains,
        )
        sample.metrics.update(result.metrics)
        if queries:  # was the first query a key, the target (the informative move)?
            sample.metrics["lookup/queried_key"] = float(moves[0] in row["table"])
            sample.metrics["lookup/queried_target"] = float(moves[0] == row["target"])
        return sample

    return rollout_fn
