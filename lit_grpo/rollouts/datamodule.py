"""The rollout data module: an `IterableDataset` of `RolloutBatch`es made by a scheduler.

`RolloutDataModule` owns this rank's row cursor, the group sampler, the scheduler and the
sampler; its training dataloader yields one batch per training step. The module pulls batches
itself (see `GRPOModule.training_step`) so no batch is sampled before the previous step's
weights are synced. The step sequence (`lit_grpo.loop.step_sequence`) pushes weights and advances
the policy version through `sync_weights`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, Optional

import lightning as L
from torch.utils.data import DataLoader, IterableDataset

from lit_grpo.advantages.registry import Advantage
from lit_grpo.config import TrainConfig
from lit_grpo.config.checks import exception_class
from lit_grpo.config.sampler import engine_on_loop
from lit_grpo.rewards.scoring import RewardScorer
from lit_grpo.rollouts import (
    GroupFilter,
    GroupSampler,
    OffPolicyScheduler,
    RowCursor,
    Scheduler,
    SynchronousScheduler,
    make_batch,
)
from lit_grpo.rollouts.checks import NoProgressError
from lit_grpo.rollouts.curriculum import CurriculumCursor, weight_fn
from lit_grpo.rollouts.rollout import RolloutFn
from lit_grpo.rollouts.waiting import WaitReport
from lit_grpo.types import RolloutBatch

log = logging.getLogger(__name__)


class RolloutStream(IterableDataset):
    """Yields one `RolloutBatch` per step until `max_steps` or the rows run out."""

    def __init__(
        self,
        scheduler: Scheduler,
        groups: GroupSampler,
        *,
        max_steps: int,
        pad_id: int,
        advantage: Optional[Advantage] = None,
        mask_truncated: bool = False,
    ) -> None:
        self.scheduler, self.groups = scheduler, groups
        self.mask_truncated = mask_truncated
        """`rollout.mask_truncated`: sequences that hit the length limit train no tokens."""
        self.max_steps, self.pad_id = max_steps, pad_id
        self.advantage = advantage
        """The advantage estimator (`advantage=<name>`; None: grpo)."""
        self.steps_done = 0
        self.rest_between_steps: Optional[Callable[[], None]] = None
        """Called once a step's rollouts are in (synchronous mode: the sampler rests while the step trains)."""
        self.rows_exhausted = False
        """True when the rows ran out before `max_steps` steps were trained (for the run summary)."""

    def __iter__(self) -> Iterator[RolloutBatch]:
        while self.max_steps < 0 or self.steps_done < self.max_steps:
            with WaitReport(self.groups, self.steps_done + 1):  # a line a minute while the step's groups are awaited
                step = self.scheduler.next_groups()
            if not step.accepted:
                self._rows_ran_out()
                return
            batch = make_batch(
                step.accepted,
                step.sampled,
                version=self.scheduler.version,
                pad_id=self.pad_id,
                counts=self.groups.take_counts(),
                timings=step.timings,
                advantage=self.advantage,
                mask_truncated=self.mask_truncated,
            )
            if self.rest_between_steps is not None:
                self.rest_between_steps()
            self.steps_done += 1
            batch.groups = step.accepted
            yield batch

    def _rows_ran_out(self) -> None:
        guard = self.groups.guard
        if self.steps_done == 0 and guard.rows > 0:  # not one group of the whole share was usable
            raise NoProgressError(guard.message(f"all {guard.rows} rows of this rank's share (they ran out first)"))
        if self.max_steps > 0 and not self.rows_exhausted:
            self.rows_exhausted = True
            log.warning(
                "the rows ran out after %d of max_steps=%d steps (data.epochs, data.max_rows or the task's rows "
                "bound them, or curriculum.retire_after retired them all): the run ends early",
                self.steps_done,
                self.max_steps,
            )
        elif self.max_steps < 0:
            log.info("the rows are used up after %d steps", self.steps_done)


class RolloutDataModule(L.LightningDataModule):
    """Streams rollouts of this rank's rows from an in-process sampler. Rows reach the rollout
    function as they were given (never tokenized or copied here: the rollout makes the prompt)."""

    def __init__(
        self,
        c: TrainConfig,
        *,
        rows: list[dict],
        tokenizer,
        sampler,
        rollout_fn: RolloutFn,
        advantage: Optional[Advantage] = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """This rank's share of `rows` (`c.data`: G, P, epochs, shuffle, lengths), scheduled as
        `c.offpolicy.synchronous` and `c.offpolicy.max_lag` say, each rollout call under
        `c.guards.rollout_timeout_s`, `c.guards.rollout_max_retries` and `c.guards.max_rows_without_progress`."""
        super().__init__()
        data = c.data
        self.tokenizer, self.sampler = tokenizer, sampler
        self.curriculum: Optional[CurriculumCursor] = None
        """The curriculum's cursor (`curriculum.kind` pools or fn), whose statistics the step
        sequence merges after every step; None: the row cursor."""
        self.cursor: RowCursor | CurriculumCursor
        if c.curriculum.kind == "none":
            self.cursor = RowCursor(rows, data.epochs, c.seed, data.shuffle, rank=rank, world_size=world_size)
        else:
            fn = weight_fn(c.curriculum.fn) if c.curriculum.fn else None
            self.cursor = self.curriculum = CurriculumCursor(
                rows, data.epochs, c.seed, data.shuffle, c.curriculum, fn=fn, rank=rank, world_size=world_size
            )
        self.groups = GroupSampler(
            rollout_fn,
            data.completions_per_prompt,
            max_seq_len=data.max_seq_len,
            min_group_size=data.min_group_size,
            filters=[],
            vocab_size=len(tokenizer),
            rollout_timeout_s=c.guards.rollout_deadline_s(c.sampler.max_completion_tokens),
            max_retries=c.guards.rollout_max_retries,
            max_rows_without_progress=c.guards.rows_without_progress(c.data.prompt_groups_per_step),
            max_completion_tokens=c.sampler.max_completion_tokens,
            overlong_buffer_len=c.rollout.overlong_buffer_len,
            overlong_penalty_factor=c.rollout.overlong_penalty_factor,
            retry_on=tuple(cls for name in c.guards.rollout_retry_on if (cls := exception_class(name)) is not None),
            failure_share=c.guards.rollout_failure_share,
            failure_window=c.guards.rollout_failure_window,
        )
        if self.curriculum is not None:
            self.groups.on_group = self.curriculum.record
        # The sampler's calls get the same bounds as the rollouts.
        sampler.bound_calls(
            c.guards.rollout_deadline_s(c.sampler.max_completion_tokens),
            data.max_seq_len,
            engine_on_loop(c.sampler.engine_thread, c.offpolicy.synchronous),
        )
        self.scheduler: Scheduler
        if c.offpolicy.synchronous:
            self.scheduler = SynchronousScheduler(
                self.cursor, self.groups, data.prompt_groups_per_step, max_concurrency=c.rollout.max_concurrency
            )
        else:
            self.scheduler = OffPolicyScheduler(
                self.cursor,
                self.groups,
                data.prompt_groups_per_step,
                max_head_offpolicy_versions=c.offpolicy.max_lag,
                max_concurrency=c.rollout.max_concurrency,
                max_rollout_versions=c.offpolicy.max_rollout_versions,
            )
        self.adapter_sync = c.adapter_sync
        """A weight sync sends the LoRA adapter alone (`push_adapter`), not every weight."""
        self.reward_scorer: Optional[RewardScorer] = None
        """The scorer of the run's reward in the rollouts (`lit_grpo.build` sets it): its timeouts are counted."""
        self.partial_rollouts = c.offpolicy.partial_rollouts
        if c.offpolicy.partial_rollouts:
            sampler.enable_partial_rollouts()
            self._align_sampler_version(self.scheduler.version)  # servers attached at build were synced once already
        self.stream = RolloutStream(
            self.scheduler,
            self.groups,
            max_steps=c.max_steps,
            pad_id=tokenizer.pad_token_id,
            advantage=advantage,
            mask_truncated=c.rollout.mask_truncated,
        )
        if c.offpolicy.synchronous:
            # A colocated vLLM frees its memory (it wakes itself for the next sync or sample); an hf
            # sampler that shares the policy's weights keeps them for training until the sync.
            self.stream.rest_between_steps = sampler.sleep

    def setup(self, stage: str) -> None:
        # An in-process sampler was built with the policy, on the CPU: it generates where the trainer trains.
        if self.trainer is not None:
            self.sampler.to_device(self.trainer.strategy.root_device)

    @property
    def group_filters(self) -> list[GroupFilter]:
        return self.groups.filters

    def add_group_filter(self, keep: GroupFilter) -> None:
        """Accept a group only if `keep(group)` is True (and every other filter agrees)."""
        if keep not in self.groups.filters:
            self.groups.filters.append(keep)

    @property
    def rows_exhausted(self) -> bool:
        """Whether the rows ran out before `max_steps` (the stream ended early)."""
        return self.stream.rows_exhausted

    @property
    def bad_rows(self):
        """This rank's rows whose own data could not be used (`lit_grpo.rollouts.groups.BadRows`)."""
        return self.groups.bad_rows

    @property
    def version(self) -> int:
        """The policy version of the sampler: version advances (weight syncs) so far."""
        return self.scheduler.version

    def push_weights(self, named_tensors, version: int) -> None:
        """Load `(name, full tensor)` pairs of the policy at `version` into the sampler."""
        # The sync makes it `version`. Never lowered: a generate call ending meanwhile would tag its
        # tokens older than the weights it ran on (after a resume the sampler already counts as the
        # saved version, and the resume's sync takes it one ahead, as before).
        if self.partial_rollouts and self.sampler.version < version - 1:
            self._align_sampler_version(version - 1)
        self.sampler.update_weights(named_tensors)

    def push_adapter(self, named_tensors, config, version: int) -> None:
        """Load the LoRA adapter of the policy at `version` (peft-named tensors and its `LoraConfig`)
        into the sampler: the adapter's name carries the version, so a resumed run continues it."""
        self.sampler.update_adapter(named_tensors, config, version)

    def _align_sampler_version(self, version: int) -> None:
        """With partial rollouts the sampler tags tokens with its weights' version: it counts as the
        scheduler does (a resumed run's scheduler starts at the saved version)."""
        if self.partial_rollouts:
            self.sampler.version = version

    def advance_version(self) -> None:
        """Later rows are sampled at the next policy version (the gate admits accordingly)."""
        self.scheduler.advance_version()

    def state_dict(self) -> dict:
        """Steps done and the scheduler's data position, gate counter and version (between steps)."""
        return {"steps_done": self.stream.steps_done, "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.stream.steps_done = state["steps_done"]
        self.scheduler.load_state_dict(state["scheduler"])
        self._align_sampler_version(self.scheduler.version)

    def close(self) -> None:
        """Cancel the sampler's in-flight generation, stop the scheduler's event loop, then the sampler's worker."""
        # First: a running engine call (the next batch's rollouts, which nobody will train on) ends
        # at its next token instead of holding the loop or the worker thread past the run's end.
        self.sampler.cancel()
        self.scheduler.close()
        self.sampler.close()

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.stream, batch_size=None, num_workers=0)

    def transfer_batch_to_device(self, batch: Any, device: Any, dataloader_idx: int) -> Any:
        # Only the tensors move: Lightning's generic walk would recurse through the record's samples
        # (milliseconds a step).
        if isinstance(batch, RolloutBatch):
            return batch.to(device)
        return super().transfer_batch_to_device(batch, device, dataloader_idx)
