"""The row cursor: this rank's disjoint, deterministic, resumable share of the rows.

Every epoch the rows are put in one seeded order, the same on every rank; rank r of W takes the
positions r, r + W, r + 2W, ... of that order. So the ranks never share a row, and the first k
rows of each of W ranks are exactly the first k·W rows a single process would take: a W-rank
run with P groups per rank samples the rows of a 1-rank run with W·P groups. Each epoch is cut
to a multiple of W so that every rank has as many rows as the others.

A position is `(epoch, index)`, the index counting this rank's rows within the epoch. Positions
handed out but not yet trained (rollouts in flight at a checkpoint) are saved and served again
first after a resume.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Protocol

Position = tuple[int, int]


class Cursor(Protocol):
    """What the schedulers draw rows from: the `RowCursor`, or the curriculum's (`lit_grpo.rollouts.curriculum`)."""

    def take_positioned(self, n: int) -> list[tuple[Position, dict]]: ...

    def context(self, position: Position) -> dict: ...

    def sample_again(self, position: Position) -> None: ...

    def state_dict(self, unfinished: Sequence[Position] = ()) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class RowCursor:
    """Rows in a seeded order per epoch, this rank's share; `(epoch, index)` is where to resume."""

    def __init__(
        self, rows: list[dict], epochs: int, seed: int, shuffle: bool, *, rank: int = 0, world_size: int = 1
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of {world_size}")
        if len(rows) < world_size:
            raise ValueError(f"{len(rows)} rows cannot give each of {world_size} ranks a share")
        self.rows, self.epochs, self.seed, self.shuffle = rows, epochs, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.rows_per_epoch = len(rows) // world_size
        """This rank's rows in each epoch (the tail beyond a multiple of the world size is left out)."""
        self.epoch, self.index = 0, 0
        self._order = self._order_of(0)
        self.replay: list[Position] = []

    def _order_of(self, epoch: int) -> list[int]:
        """Row numbers of this rank's share of `epoch`, in order."""
        order = list(range(len(self.rows)))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order[self.rank : self.rows_per_epoch * self.world_size : self.world_size]

    def row_at(self, position: Position) -> dict:
        epoch, index = position
        order = self._order if epoch == self.epoch else self._order_of(epoch)
        return self.rows[order[index]]

    def context(self, position: Position) -> dict:
        """The rollout context keywords of the row at `position` (see `lit_grpo.rollouts.context`)."""
        epoch, index = position
        order = self._order if epoch == self.epoch else self._order_of(epoch)
        per_epoch = self.rows_per_epoch * self.world_size
        return {
            "epoch": epoch,
            "row_index": order[index],
            "cursor_index": epoch * per_epoch + index * self.world_size + self.rank,
            "end_of_epoch": index == self.rows_per_epoch - 1,
        }

    def take_positioned(self, n: int) -> list[tuple[Position, dict]]:
        """Up to n next `(position, row)` pairs, replayed positions first (fewer only when the last epoch ends)."""
        out: list[tuple[Position, dict]] = []
        while self.replay and len(out) < n:
            position = self.replay.pop(0)
            out.append((position, self.row_at(position)))
        while len(out) < n and self.epoch < self.epochs:
            if self.index >= self.rows_per_epoch:
                self.epoch, self.index = self.epoch + 1, 0
                self._order = self._order_of(self.epoch)
                continue
            out.append(((self.epoch, self.index), self.rows[self._order[self.index]]))
            self.index += 1
        return out

    def sample_again(self, position: Position) -> None:
        """Serve a position handed out but not trained again, before any new row."""
        self.replay.append(position)

    def take(self, n: int) -> list[dict]:
        """Up to n next rows (fewer only when the last epoch ends)."""
        return [row for _, row in self.take_positioned(n)]

    def state_dict(self, unfinished: Sequence[Position] = ()) -> dict:
        """The position to resume from; `unfinished` positions are served again first."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "replay": sorted([*self.replay, *unfinished]),
            "num_rows": len(self.rows),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
        }

    def load_state_dict(self, state: dict) -> None:
        mine = {
            "num_rows": len(self.rows),
            "seed": self.seed,
            "shuffle": self.shuffle,
            "rank": self.rank,
            "world_size": self.world_size,
        }
        for key, value in mine.items():
            if state.get(key, value) != value:
                raise ValueError(
                    f"the checkpoint's data cursor was saved with {key}={state[key]!r}, this run has {value!r}"
                )
        self.epoch, self.index = state["epoch"], state["index"]
        self._order = self._order_of(self.epoch)
        self.replay = [tuple(p) for p in state["replay"]]
