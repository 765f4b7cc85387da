"""The lookup game: a multi-turn CPU task whose answer is reachable only through an informative query.

Each row hides a random table from `num_keys` keys (letters a, b, ...) to values and names a
target key; the prompt asks for the target's value, e.g. `c?`. Two cues say which move comes
next: `?` a query, `>` the answer (one cue for both lets "a digit after the cue", learnt on the
answer turn, leak into the query turn: measured, the policy then stops querying keys).
The policy plays one-token moves (`lit_grpo.envs.lookup` runs them):

    c?         prompt: what is c's value? your query
    a          query turn: a key
    =3>        environment reply: the key's value (`=->` when the move is not a key), then the
               next cue (`?` while queries remain, so `queries` query turns in all; default `hops`)
    3          final turn: the answer, rewarded 1.0 when it is the target's value (`reward`)

The table is drawn afresh per row, so only a query of the target key (then, with `hops=2`, of
the key it points to) tells the answer; a guess is right 1 time in `num_values`. The moves' turn
structure is what IGPO's information gain credits: a query of the target raises the policy's
belief in the answer. A random-init policy learns to read replies before it learns to query
when some rows show the lookup in the prompt (`shown_frac`: `c=3>`, answered at once; measured,
without them no run learned to query within 1800 steps). Rows carry `prompt` (text), `table`
(key -> value, one character each), `target`, `answer` and `queries`; held-out rows come from
another seed.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Optional

from lit_grpo.config import require
from lit_grpo.rewards.registry import inline_reward
from lit_grpo.tasks.registry import RewardFn, register_task

KEYS = "abcdefgh"
"""The keys a table can have (the first `num_keys`); `model.alphabet=lookup` holds them."""
QUERY_CUE = "?"
"""Ends the prompt and a reply when a query move comes next."""
ANSWER_CUE = ">"
"""Ends the reply (or the prompt, with no queries) when the answer move comes next."""
UNKNOWN = "-"
"""The reply's value when the move is not a key."""
_EVAL_SEED_OFFSET = 1_000_003  # held-out rows: the same distribution, other draws


@dataclass
class LookupOptions:
    """Options of `task=lookup` (`conf/task/lookup.yaml`)."""

    num_rows: int = 4096
    """Rows generated, each with its own random table."""
    num_keys: int = 4
    """Keys of each table: the first `num_keys` of a..h."""
    num_values: int = 10
    """Values are the digits 0..num_values-1 (a blind guess is right 1 time in num_values)."""
    hops: int = 1
    """1: the target's value is the answer. 2: the target's value is another key (a pointer),
    whose value is the answer: two queries are needed."""
    queries: Optional[int] = None
    """Query turns before the answer turn (null: `hops`)."""
    shown_frac: float = 0.0
    """Fraction of rows whose prompt already shows the answer's lookup (`c=3>`, answered at once,
    no query): they teach a random-init policy to read a reply before it has learnt to query."""

    def __post_init__(self) -> None:
        require(self.num_rows >= 1, "task.num_rows", "must be >= 1")
        require(2 <= self.num_keys <= len(KEYS), "task.num_keys", f"must be in [2, {len(KEYS)}], got {self.num_keys}")
        require(2 <= self.num_values <= 10, "task.num_values", f"must be in [2, 10], got {self.num_values}")
        require(self.hops in (1, 2), "task.hops", f"must be 1 or 2, got {self.hops}")
        require(self.queries is None or self.queries >= 0, "task.queries", f"must be null or >= 0, got {self.queries}")
        require(0.0 <= self.shown_frac <= 1.0, "task.shown_frac", f"must be in [0, 1], got {self.shown_frac}")

    @property
    def num_queries(self) -> int:
        return self.hops if self.queries is None else self.queries


def make_row(rng: random.Random, opts: LookupOptions) -> dict:
    """One game: a random table, a target key, and the answer its `hops` lookups lead to."""
    keys = KEYS[: opts.num_keys]
    table = {k: str(rng.randrange(opts.num_values)) for k in keys}
    target = rng.choice(keys)
    if opts.hops == 2:  # the target points to another key, which holds the answer
        table[target] = rng.choice([k for k in keys if k != target])
    answer, queries = resolve(table, target), opts.num_queries
    prompt = f"{target}{QUERY_CUE if queries else ANSWER_CUE}"
    if rng.random() < opts.shown_frac:  # the last lookup shown: the answer is one copy away
        prompt, queries = (
            f"{target}={table[target]}{ANSWER_CUE}" if opts.hops == 1 else f"{table[target]}={answer}{ANSWER_CUE}",
            0,
        )
    return {"prompt": prompt, "table": table, "target": target, "answer": answer, "queries": queries}


def resolve(table: dict, key: str) -> str:
    """Follow pointers from `key` until a digit (the tables `make_row` builds have no cycles)."""
    value = table[key]
    return resolve(table, value) if value in table else value


def make_rows(opts: LookupOptions, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [make_row(rng, opts) for _ in range(opts.num_rows)]


def train_rows(opts: LookupOptions, *, seed: int, max_rows: int) -> list[dict]:
    rows = make_rows(opts, seed)
    return rows[:max_rows] if max_rows else rows


def held_out_rows(opts: LookupOptions, *, seed: int, count: int) -> list[dict]:
    return make_rows(dataclasses.replace(opts, num_rows=count), seed + _EVAL_SEED_OFFSET)


def reply(row: dict, move: str, queries_left: int) -> str:
    """The environment's answer to a query move: `=<value>` (`=-` when the move is not a key),
    then the cue of the next move: `?` while `queries_left` > 0, else `>` (answer)."""
    return f"={row['table'].get(move, UNKNOWN)}{QUERY_CUE if queries_left > 0 else ANSWER_CUE}"


@inline_reward
def answer_reward(completion_text: str, row: dict) -> float:
    """1.0 when the final move is the row's answer, else 0.0."""
    return 1.0 if completion_text.strip() == row["answer"] else 0.0


def reward(opts: LookupOptions) -> RewardFn:
    return answer_reward


register_task("lookup", options=LookupOptions, rows=train_rows, eval_rows=held_out_rows, reward=reward)
