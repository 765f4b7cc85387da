"""A curriculum that follows the policy: rows drawn by their online pass rate (`curriculum.kind`).

Each row of the dataset (by its index) keeps `RowStats`: groups completed, samples, passes (a
sample passes when its reward is >= `curriculum.pass_reward`), groups whose every sample passed,
and a pass rate (an EMA over its groups). A group counts when it completes, whether the filters
keep it or not: a uniform all-passing group, which the filter drops, is what says a row is easy.

`CurriculumCursor` stands where the `RowCursor` stands (same interface) and draws rows with
replacement, each with probability its weight over the sum of the live rows' weights:

- `pools`: easy (pass rate >= `easy_above`), hard (<= `hard_below`), normal otherwise, rows never
  drawn included; a row weighs its pool's `pool_weights` entry.
- `fn`: the user's `module:function(stats) -> weights`, one weight per row.
- `retire_after` N > 0: a row with N all-passing groups weighs 0 from then on (retired).

Ranks: rank r of W owns the rows at positions r, r + W, ... of the seeded order of epoch 0 (the
cursor's share), so ranks never draw the same row. Statistics change only at `merge`, which the
step sequence calls after every step with every rank's updates (an all-gather), in rank order:
every rank holds the same statistics, and the weights stay fixed during a step. Within a step a
rank draws a row at most once while it has rows not yet drawn in that step.

Draw k of rank r uses `random.Random("curriculum:<seed>:<r>:<k>")`: the sampler's RNG state is
the draw counter, so the state (statistics, counter, replayed positions) is plain JSON and a
resumed run draws what the uninterrupted one did. The run's draws are bounded as the cursor's
are: `data.epochs` × this rank's share of the rows; when every row of the share weighs 0 (all
retired) the rows run out.
"""

from __future__ import annotations

import dataclasses
import math
import random
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Optional

from lit_grpo.config.checks import ConfigError
from lit_grpo.config.curriculum import CurriculumConfig
from lit_grpo.errors import UserError, import_user_object
from lit_grpo.rollouts.cursor import Position
from lit_grpo.types import PromptGroup

Update = tuple[int, int, int]
"""One completed group: `(row index, samples, passes)`."""
WeightFn = Callable[[list["RowStats"]], Sequence[float]]


@dataclass
class RowStats:
    """What one row's groups have shown so far."""

    drawn: int = 0
    """Groups of this row completed (kept or filtered)."""
    samples: int = 0
    """Scored samples of those groups (runs, for multi-segment rollouts)."""
    passes: int = 0
    """Of those, the ones with reward >= `curriculum.pass_reward`."""
    solved: int = 0
    """Groups in which every scored sample passed."""
    pass_rate: Optional[float] = None
    """EMA of its groups' pass fractions (`curriculum.pass_rate_ema`); None until a group had a sample."""


def weight_fn(spec: str) -> WeightFn:
    """The function `curriculum.fn` names (`module:function`); `ConfigError` naming the field when it
    cannot be imported or is not callable with one argument."""
    import inspect

    try:
        fn = import_user_object(spec, "curriculum.fn")
    except UserError as err:
        raise ConfigError(str(err)) from err.__cause__
    if not callable(fn):
        raise ConfigError(f"config field `curriculum.fn`: {spec!r} is a {type(fn).__name__}, not a function")
    try:
        inspect.signature(fn).bind([])
    except TypeError as err:
        raise ConfigError(f"config field `curriculum.fn`: {spec!r} must take (stats): {err}") from None
    except ValueError:  # no signature to read (a builtin): the first call will tell
        pass
    return fn


def group_update(row_index: int, rewards: Sequence[float], pass_reward: float) -> Update:
    """A completed group of `rewards` (one per run) as an update: `(row, samples, passes)`."""
    return row_index, len(rewards), sum(1 for r in rewards if r >= pass_reward)


def apply_update(stats: RowStats, samples: int, passes: int, ema: float) -> None:
    """Count one group of `samples` with `passes` into `stats` (a group with no sample counts as drawn only)."""
    stats.drawn += 1
    if samples == 0:
        return
    stats.samples += samples
    stats.passes += passes
    stats.solved += int(passes == samples)
    fraction = passes / samples
    stats.pass_rate = fraction if stats.pass_rate is None else (1 - ema) * stats.pass_rate + ema * fraction


def pool_of(stats: RowStats, easy_above: float, hard_below: float) -> str:
    """`easy`, `normal` or `hard` by pass rate; a row never scored is `normal`."""
    if stats.pass_rate is None:
        return "normal"
    if stats.pass_rate >= easy_above:
        return "easy"
    if stats.pass_rate <= hard_below:
        return "hard"
    return "normal"


def is_retired(stats: RowStats, retire_after: int) -> bool:
    return retire_after > 0 and stats.solved >= retire_after


def _weight(value: object) -> Optional[float]:
    """`value` as a weight: a real number (a Python, numpy or 0-d torch one), finite and >= 0; else None."""
    if isinstance(value, (str, bytes, bool)) or not hasattr(type(value), "__float__"):
        return None
    try:
        weight = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):  # a tensor of several elements
        return None
    return weight if math.isfinite(weight) and weight >= 0 else None


def returned_weights(returned: object, rows: int, spec: Optional[str]) -> list[float]:
    """What `curriculum.fn` returned as `rows` floats: any sequence or array of numbers (numpy's
    float32 and ndarray included). `UserError` naming the field otherwise."""
    must = f"config field `curriculum.fn`: {spec} must return one finite weight >= 0 per row ({rows}, a list or array)"
    try:
        values = list(returned)  # type: ignore[call-overload]
    except TypeError:
        raise UserError(f"{must}, got {type(returned).__name__} {returned!r:.60}") from None
    weights = [_weight(v) for v in values]
    if len(weights) != rows:
        raise UserError(f"{must}, got {len(weights)} weights")
    bad = next((i for i, w in enumerate(weights) if w is None), None)
    if bad is not None:
        raise UserError(f"{must}, got {values[bad]!r} for row {bad}")
    return weights  # type: ignore[return-value]


def row_weights(stats: list[RowStats], c: CurriculumConfig, fn: Optional[WeightFn] = None) -> list[float]:
    """One draw weight per row: its pool's weight (`pools`) or `fn(stats)`'s (`fn`), 0 once retired.
    `UserError` naming `curriculum.fn` when the function returns anything but len(stats) finite weights >= 0."""
    if c.kind == "fn":
        assert fn is not None
        weights = returned_weights(fn([dataclasses.replace(s) for s in stats]), len(stats), c.fn)  # copies: stats stay
    else:
        by_pool = dict(c.pool_weights)
        weights = [float(by_pool[pool_of(s, c.easy_above, c.hard_below)]) for s in stats]
    return [0.0 if is_retired(s, c.retire_after) else float(w) for s, w in zip(stats, weights)]


def pool_sizes(stats: list[RowStats], c: CurriculumConfig) -> dict[str, float]:
    """`curriculum/easy`, `/normal`, `/hard` (live rows) and `/retired` over all rows."""
    keys = {"easy": "curriculum/easy", "normal": "curriculum/normal", "hard": "curriculum/hard"}
    sizes = dict.fromkeys([*keys.values(), "curriculum/retired"], 0.0)
    for s in stats:
        retired = is_retired(s, c.retire_after)
        sizes["curriculum/retired" if retired else keys[pool_of(s, c.easy_above, c.hard_below)]] += 1
    return sizes


def weighted_pick(weights: Sequence[float], candidates: Sequence[int], u: float) -> Optional[int]:
    """The candidate at `u` (in [0, 1)) of the cumulative weights of `candidates`; None when they all weigh 0."""
    total = math.fsum(weights[i] for i in candidates)
    if total <= 0:
        return None
    target, acc = u * total, 0.0
    last = None
    for i in candidates:
        if weights[i] > 0:
            acc += weights[i]
            last = i
            if target < acc:
                return i
    return last  # rounding: u·total at the very top


class CurriculumCursor:
    """This rank's draws of rows by weight; the `RowCursor` interface, plus `record` and `merge`."""

    def __init__(
        self,
        rows: list[dict],
        epochs: int,
        seed: int,
        shuffle: bool,
        config: CurriculumConfig,
        *,
        fn: Optional[WeightFn] = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if len(rows) < world_size:
            raise ValueError(f"{len(rows)} rows cannot give each of {world_size} ranks a share")
        self.rows, self.epochs, self.seed, self.shuffle = rows, epochs, seed, shuffle
        self.config, self.fn = config, fn
        self.rank, self.world_size = rank, world_size
        self.rows_per_epoch = len(rows) // world_size
        order = list(range(len(rows)))
        if shuffle:
            random.Random(seed * 1_000_003).shuffle(order)  # the cursor's epoch-0 order: the same share
        self.share = sorted(order[rank : self.rows_per_epoch * world_size : world_size])
        """The row indices this rank draws from."""
        self.stats = [RowStats() for _ in rows]
        """One per row of the dataset, the same on every rank after each `merge`."""
        self.draws = 0
        """Draws made so far by this rank (draw k uses its own seeded RNG)."""
        self.replay: list[Position] = []
        self.drawn_this_step: set[int] = set()
        self.pending: list[Update] = []
        """This rank's completed groups since the last merge."""
        self._lock = threading.Lock()  # the off-policy scheduler draws and records on its own thread
        self.weights = row_weights(self.stats, config, fn)

    # ------------------------------------------------------------------ the cursor's interface

    def row_at(self, position: Position) -> dict:
        return self.rows[position[1]]

    def context(self, position: Position) -> dict:
        """The rollout context keywords of the row at `position` (`(draw, row index)`)."""
        draw, row_index = position
        return {
            "epoch": draw // max(self.rows_per_epoch, 1),
            "row_index": row_index,
            "cursor_index": draw * self.world_size + self.rank,
            "end_of_epoch": (draw + 1) % max(self.rows_per_epoch, 1) == 0,
        }

    def take_positioned(self, n: int) -> list[tuple[Position, dict]]:
        """Up to n `(position, row)` pairs, replayed positions first; fewer when the draws are used
        up (`epochs` × the share) or every row of the share weighs 0."""
        out: list[tuple[Position, dict]] = []
        with self._lock:
            while self.replay and len(out) < n:
                position = self.replay.pop(0)
                out.append((position, self.row_at(position)))
            while len(out) < n and self.draws < self.epochs * self.rows_per_epoch:
                row_index = self._draw(self.draws)
                if row_index is None:
                    if self.draws == 0:  # not a row drawn yet: the run would end having trained nothing
                        raise UserError(self._nothing_to_draw())
                    break
                out.append(((self.draws, row_index), self.rows[row_index]))
                self.drawn_this_step.add(row_index)
                self.draws += 1
        return out

    def _nothing_to_draw(self) -> str:
        c = self.config
        if c.kind == "fn":
            field, given, fix = "curriculum.fn", c.fn, "give rows never seen (pass_rate None) a weight > 0"
        else:
            field, given, fix = (
                "curriculum.pool_weights",
                str(dict(c.pool_weights)),
                "give `normal`, rows never seen, a weight > 0",
            )
        return (
            f"config field `{field}` ({given}) weighs every row of this rank's share 0 before the first step: no row "
            f"can be drawn and nothing would train; give {fix} a weight > 0"
        )

    def _draw(self, k: int) -> Optional[int]:
        """Draw k: a row of the share by weight, one not yet drawn this step while there is one."""
        u = random.Random(f"curriculum:{self.seed}:{self.rank}:{k}").random()
        fresh = [i for i in self.share if i not in self.drawn_this_step]
        picked = weighted_pick(self.weights, fresh, u)
        return picked if picked is not None else weighted_pick(self.weights, self.share, u)

    def sample_again(self, position: Position) -> None:
        with self._lock:
            self.replay.append(position)

    def take(self, n: int) -> list[dict]:
        return [row for _, row in self.take_positioned(n)]

    # ------------------------------------------------------------------ statistics

    def record(self, group: PromptGroup, context: Optional[dict]) -> None:
        """A group of the row `context["row_index"]` completed (filtered or not): counted at the next merge."""
        if context is None or "row_index" not in context:
            return
        update = group_update(context["row_index"], group.rewards, self.config.pass_reward)
        with self._lock:
            self.pending.append(update)

    def take_pending(self) -> list[Update]:
        """This rank's updates since the last merge, handed to `merge` (through an all-gather)."""
        with self._lock:
            pending, self.pending = self.pending, []
        return pending

    def merge(self, per_rank: list[list[Update]]) -> dict[str, float]:
        """Apply every rank's updates (in rank order, the same on every rank), recompute the
        weights, and start a new step. Returns the step's metrics: the pool sizes after it
        (`curriculum/easy`, `/normal`, `/hard`, `/retired`), the pass fraction of its groups'
        samples (`curriculum/pass_rate`) and the mean pass rate its rows had when drawn, over rows
        seen before (`curriculum/drawn_pass_rate`)."""
        with self._lock:
            samples = passes = 0
            known: list[float] = []  # the drawn rows' pass rates as they were drawn (rows seen before)
            for updates in per_rank:
                for row_index, n, p in updates:
                    stats = self.stats[row_index]
                    if stats.pass_rate is not None:
                        known.append(stats.pass_rate)
                    apply_update(stats, n, p, self.config.pass_rate_ema)
                    samples, passes = samples + n, passes + p
            self.weights = row_weights(self.stats, self.config, self.fn)
            self.drawn_this_step = set()
            metrics = pool_sizes(self.stats, self.config)
        if samples:
            metrics["curriculum/pass_rate"] = passes / samples
        if known:
            metrics["curriculum/drawn_pass_rate"] = math.fsum(known) / len(known)
        return metrics

    # ------------------------------------------------------------------ state

    def state_dict(self, unfinished: Sequence[Position] = ()) -> dict:
        """Statistics, the draw counter and the positions to serve again: ints, floats and lists only."""
        with self._lock:
            return {
                "kind": self.config.kind,
                "draws": self.draws,
                "replay": sorted([list(p) for p in [*self.replay, *unfinished]]),
                "drawn_this_step": sorted(self.drawn_this_step),
                "pending": [list(u) for u in self.pending],
                "stats": [[s.drawn, s.samples, s.passes, s.solved, s.pass_rate] for s in self.stats],
                "num_rows": len(self.rows),
                "seed": self.seed,
                "shuffle": self.shuffle,
                "rank": self.rank,
                "world_size": self.world_size,
            }

    def load_state_dict(self, state: dict) -> None:
        mine = {
            "kind": self.config.kind,
            "num_rows": len(self.rows),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
        }
        for key, value in mine.items():
            if state.get(key) != value:
                raise ValueError(
                    f"the checkpoint's curriculum was saved with {key}={state.get(key)!r}, this run has {value!r}"
                )
        with self._lock:
            self.draws = state["draws"]
            self.replay = [tuple(p) for p in state["replay"]]
            self.drawn_this_step = set(state["drawn_this_step"])
            self.pending = [tuple(u) for u in state["pending"]]
            self.stats = [RowStats(*s) for s in state["stats"]]
            self.weights = row_weights(self.stats, self.config, self.fn)
