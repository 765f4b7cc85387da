"""The end of a rollout step, in one place and a fixed order.

After a step's optimizer steps, `GRPOModule.on_train_batch_end` runs `StepSequence.finish_step`,
on every rank:

    0. merge    the step's metrics over all ranks (rewards pooled, counts summed, slowest timings), and
                the curriculum's row statistics (`curriculum.kind` pools or fn: every rank's groups)
    1. sync     if due (every `offpolicy.weight_sync_interval` steps): the policy's full weights into the
                sampler; then the policy version advances (with `offpolicy.weight_sync_interval=0` the
                sampler keeps its weights and only the version advances, every step, so the
                off-policy gate keeps admitting rows)
    2. save     a DCP checkpoint if due (`checkpoint.save_interval`)
    3. eval     greedy accuracy on the held-out rows if due (`eval_interval`)
    4. log      the metrics to the loggers (and the history the run summary reads)

A stop signal (`lit_grpo.loop.signals`) received during the step makes its checkpoint due (when
checkpoints are on) and skips its evaluation; training then stops. One received while the
trainer waits for rollouts abandons the wait and checkpoints the last finished step from the
state kept at its end (`stop_between_steps`).

The policy version is advanced here and nowhere else; no callback is needed for training to
advance. Lightning runs every callback's `on_train_batch_end` before the module's, so callbacks
see a trained step whose weights are not yet synced. On resume, the same `sync_sampler` path
gives the fresh sampler the weights it held when the checkpoint was taken.

`policy/version` is the trainer's policy version during the step: the version advances before
it. A sample's version offset (`async/version_offset_*`) is that minus the version it was sampled at.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger

from lit_grpo.errors import EnvironmentFault, UserError
from lit_grpo.loop.distributed import all_gather_objects, all_reduce, is_distributed
from lit_grpo.loop.evaluation import Evaluator
from lit_grpo.loop.metrics import MetricHistory, merge_step_metrics
from lit_grpo.loop.mfu import mfu_metrics
from lit_grpo.loop.signals import StopSignals
from lit_grpo.models.lora import adapter_config
from lit_grpo.models.weights import PolicyWeights, first_nonfinite
from lit_grpo.run.peak import machine_peak
from lit_grpo.run.state import RunCheckpointer, capture_rng, restore_rng
from lit_grpo.types import PromptGroup, RolloutRecord

if TYPE_CHECKING:
    from lit_grpo.rollouts.datamodule import RolloutDataModule

log = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one rank's training step hands to the step sequence."""

    record: RolloutRecord
    """This rank's rollout record (merged over ranks before logging)."""
    rewards_B: torch.Tensor
    """Rewards of the trained batch. Shape: [B]."""
    advantages_B: torch.Tensor
    """Advantages of the trained batch (per-token ones: their mean over each sequence). Shape: [B]."""
    groups: list[PromptGroup] = field(default_factory=list)
    """The accepted groups the batch was made from, in batch order."""
    train_metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    """`train/*` scalars as this rank's share of the global value: summed over ranks, they are
    the loss and the token means of the whole step (weights are tokens over the global count)."""
    timings: dict[str, float] = field(default_factory=dict)
    """`perf/ref_s`, `perf/train_s` of this rank, `train_tokens`, its real tokens,
    `train_token_slots`, the token slots of one pass of its forwards over them (padding included),
    and its model FLOPs by phase (`sample_flops`, `ref_flops`, `train_flops`: `lit_grpo.loop.mfu`)."""


class NonFiniteTraining(UserError, RuntimeError):
    """The loss or the gradients stayed non-finite: training stops instead of corrupting the weights."""


def check_finite(policy, what: str) -> None:
    """Refuse (on every rank) to `what` when any rank's policy holds a NaN or an infinity."""
    bad = first_nonfinite(policy)
    if all_reduce(torch.tensor(float(bad is not None)), "max"):
        raise NonFiniteTraining(f"refusing to {what}: the policy's weights are not finite ({bad or 'on another rank'})")


class StepSequence:
    """Weight sync and version → checkpoint → evaluation → metrics, after every step."""

    def __init__(
        self,
        datamodule: RolloutDataModule,
        *,
        weight_sync_interval: int = 1,
        checkpointer: Optional[RunCheckpointer] = None,
        evaluators: tuple[Evaluator, ...] = (),
        resume_from: Optional[Path] = None,
        log_every_n_steps: int = 1,
        stop: Optional[StopSignals] = None,
    ) -> None:
        self.datamodule = datamodule
        self.weight_sync_interval = weight_sync_interval
        self.checkpointer = checkpointer
        self.evaluators = tuple(evaluators)
        """Run in this order when due (greedy accuracy, then the Python caller's `evaluation_fn`)."""
        self.resume_from = resume_from
        self.log_every_n_steps = max(log_every_n_steps, 1)
        self.history = MetricHistory()
        self.stop = stop or StopSignals()
        """The stop signals received (installed by `lit_grpo.train.train` around the fit)."""
        self.stopping = False
        """True once every rank agreed to stop on a signal (training ends after this step)."""
        self._end_of_last_step: Optional[tuple[dict, dict]] = None  # data state and RNG, for a stop between steps
        self._rng_to_restore: Optional[dict] = None
        self._last_end: Optional[float] = None
        self._policy_weights: Optional[PolicyWeights] = None  # the strategy's model, looked up at the first sync
        self.peak_flops_per_s: Optional[float] = None
        """One process's peak matmul FLOP/s (`lit_grpo.run.peak`), found at the start; None: no `perf/mfu`."""

    # ------------------------------------------------------------------ the sequence

    def finish_step(self, trainer: L.Trainer, module: L.LightningModule, result: StepResult) -> dict[str, float]:
        """Run the end of step `module.rollout_step`; returns its metrics (every rank gets them)."""
        step = module.rollout_step
        metrics = merge_step_metrics(result.record, result.train_metrics, result.timings)
        if (curriculum := self.datamodule.curriculum) is not None:
            # Every rank applies every rank's groups in rank order: the same statistics everywhere.
            metrics.update(curriculum.merge(all_gather_objects(curriculum.take_pending())))
        # The entropy controls see the step's mean over every rank (the same on each: no collective).
        if (control := getattr(module, "entropy_control", None)) is not None and control.config.watched:
            metrics.update(control.after_step(metrics.get("train/entropy", 0.0), warn=trainer.global_rank == 0))
        metrics["train/lr"] = module.lr_schedulers().get_last_lr()[0]
        metrics["policy/version"] = float(self.datamodule.version)
        if (moving := getattr(module, "moving_reference", None)) is not None:  # the same on every rank
            metrics.update(moving.metrics())
        self.history.append(metrics)  # before the checkpoint, which saves the history
        self.stopping = self._stop_requested_anywhere()

        try:
            metrics.update(self.sync(module, step))
        except EnvironmentFault as fault:  # step `step` is trained: keep it, then stop
            self.datamodule.advance_version()  # as a sync would have: the saved state is step `step`'s end
            # This rank's sampler alone failed: with several ranks a save (collectives) would meet the
            # others in their next step's first collective and wait forever (seen in the cluster
            # rehearsal). The last periodic checkpoint stands; the peer watch stops the others.
            if self.checkpointer is not None and not trainer.fast_dev_run and not is_distributed():
                self._save(trainer, module, step)
            raise self.stopped_by(fault, trainer, module) from None
        if self.checkpointer is not None and (
            self.checkpointer.due(trainer, step) or self.stopping and not trainer.fast_dev_run
        ):
            metrics["perf/checkpoint_s"] = self._save(trainer, module, step)
        for evaluator in self.evaluators:
            if evaluator.due(step) and not self.stopping:
                metrics.update(evaluator.evaluate(step, trainer.global_rank, trainer.world_size))

        now = time.perf_counter()
        metrics["perf/step_s"] = (
            now - self._last_end
            if self._last_end is not None
            else sum(metrics.get(k, 0.0) for k in ("perf/sample_s", "perf/ref_s", "perf/train_s"))
        )
        self._last_end = now
        if self.peak_flops_per_s is not None:
            metrics.update(mfu_metrics(metrics, self.peak_flops_per_s, trainer.world_size))
        if step % self.log_every_n_steps == 0 or self.stopping:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=step - 1)
        if self.stopping:
            trainer.should_stop = True
        elif self.checkpointer is not None:
            self._end_of_last_step = (self.datamodule.state_dict(), capture_rng())
        return metrics

    def _stop_requested_anywhere(self) -> bool:
        """Whether any rank received a stop signal (a collective, so that every rank stops at this step)."""
        return bool(all_reduce(torch.tensor(float(self.stop.requested)), "max"))

    def stop_between_steps(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """A stop signal came while waiting for rollouts (on some rank): checkpoint the last finished
        step as it was at its end, if it is not saved yet, and end training (every rank calls it)."""
        self.stopping = True
        trainer.should_stop = True
        self._save_end_of_last_step(trainer, module)

    def _save_end_of_last_step(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        step = module.rollout_step
        if (
            self.checkpointer is None
            or self._end_of_last_step is None
            or self.checkpointer.last_saved_step == step
            or trainer.fast_dev_run
        ):
            return
        data_state, rng = self._end_of_last_step
        self._save(trainer, module, step, data_state=data_state, rng=rng)

    def stop_on_fault(self, fault: EnvironmentFault, trainer: L.Trainer, module: L.LightningModule) -> EnvironmentFault:
        """Something outside the run failed while waiting for rollouts (a vLLM server died): save
        the last finished step as it was at its end, and return the error to raise, which says
        where `resume=auto` continues.

        With several ranks the fault is this rank's alone: the others are elsewhere in the step, so a
        save (collectives on every rank) would wait for them forever (seen: this rank in the save's
        first all-reduce, the other in Lightning's next-step broadcast). The last periodic checkpoint
        stands; the other ranks are stopped by the peer watch (`lit_grpo.loop.peers`)."""
        self.stopping = True
        trainer.should_stop = True
        if not is_distributed():
            self._save_end_of_last_step(trainer, module)
        return self.stopped_by(fault, trainer, module)

    def stopped_by(self, fault: EnvironmentFault, trainer: L.Trainer, module: L.LightningModule) -> EnvironmentFault:
        """`fault`'s message and what to do next: the step `resume=auto` continues from, if one was saved."""
        step = module.rollout_step
        restart = getattr(fault, "remedy", "Start the server again (or point sampler.server_urls at a live one)")
        if self.checkpointer is not None and self.checkpointer.last_saved_step is not None:
            saved = self.checkpointer.last_saved_step
            what = f"{restart} and run again with resume=auto: it continues from step {saved}, the last checkpoint."
            if saved != step:
                what = f"Step {step} finished but only step {saved} is saved. " + what
        elif step == 0:
            what = f"No step had finished. {restart} and run again."
        else:
            what = (
                f"Step {step} had finished, but checkpoints are off (checkpoint.save_interval=0), so the run cannot "
                f"continue: {restart} and run again (set checkpoint.save_interval=N to make a run resumable after "
                "a fault)."
            )
        return EnvironmentFault(f"{str(fault).rstrip('.')}; training stopped after step {step}. {what}")

    def sync(self, module: L.LightningModule, step: int) -> dict[str, float]:
        """Phase 1: the weights into the sampler if a sync is due, and the version advance."""
        if self.weight_sync_interval > 0 and step % self.weight_sync_interval:
            return {}
        start = time.perf_counter()
        if self.weight_sync_interval > 0:
            self.sync_sampler(module, self.datamodule.version + 1)
        self.datamodule.advance_version()
        if self.weight_sync_interval == 0:
            return {}
        metrics = {"perf/weight_sync_s": time.perf_counter() - start}
        sent = getattr(self.datamodule.sampler, "last_sync_bytes", None)
        if sent:  # a sampler that knows what it sent (vLLM servers: the weights file, or the adapter's)
            metrics["perf/weight_sync_mb"] = sent / 2**20
        return metrics

    def sync_sampler(self, module: L.LightningModule, version: int) -> None:
        """The policy's full weights into this rank's sampler, as policy `version`: gathered tensor by
        tensor when the policy is sharded (a collective, in the same order on every rank). Through the
        strategy's model, because a sharding strategy may wrap the whole module, not the policy alone."""
        model = module.trainer.strategy.model
        if self._policy_weights is None or self._policy_weights.model is not model:
            self._policy_weights = PolicyWeights(model, prefix="policy.")
        with torch.no_grad():
            if self.datamodule.adapter_sync:  # a LoRA policy's adapter alone (`sampler.lora_sync=adapter`)
                adapter = self._policy_weights.adapter_tensors()
                self.datamodule.push_adapter(adapter, adapter_config(module.policy), version)
            else:
                self.datamodule.push_weights(self._policy_weights.named_tensors(), version)

    def _save(
        self,
        trainer: L.Trainer,
        module: L.LightningModule,
        step: int,
        *,
        data_state: Optional[dict] = None,
        rng: Optional[dict] = None,
    ) -> float:
        start = time.perf_counter()
        assert self.checkpointer is not None, "saved only when checkpoints are on"
        check_finite(module.policy, f"checkpoint step {step}")
        holds_policy = self.weight_sync_interval > 0 and step % self.weight_sync_interval == 0
        self.checkpointer.save(
            trainer,
            module,
            step,
            {
                "sampler_holds_policy": holds_policy,
                "datamodule": data_state if data_state is not None else self.datamodule.state_dict(),
                "sequence": self.state_dict(),
                "entropy_control": module.entropy_control.state_dict() if hasattr(module, "entropy_control") else {},
                "moving_reference": moving.state_dict()
                if (moving := getattr(module, "moving_reference", None)) is not None
                else {},
                "callbacks": {cb.state_key: cb.state_dict() for cb in trainer.callbacks if cb.state_dict()},
            },
            rng=rng,
        )
        for logger in trainer.loggers:  # what the loggers hold is on disk too
            logger.save()
        return time.perf_counter() - start

    # ------------------------------------------------------------------ start, resume, end

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if getattr(module, "flop_shape", None) is not None:  # a model whose FLOPs are counted
            self.peak_flops_per_s = machine_peak(module.device, str(trainer.precision))
        if self.resume_from is None:
            self._evaluate_at_start(trainer)
            self._last_end = time.perf_counter()
            return
        self._last_end = time.perf_counter()
        assert self.checkpointer is not None, "a resume always has a checkpointer (build.step_sequence)"
        state = self.checkpointer.load(self.resume_from, trainer, module)
        module.rollout_step = state["step"]
        self.datamodule.load_state_dict(state["datamodule"])
        self.load_state_dict(state["sequence"])
        if hasattr(module, "entropy_control"):
            module.entropy_control.load_state_dict(state.get("entropy_control"))
        if (moving := getattr(module, "moving_reference", None)) is not None:  # its weights: the checkpointer's
            moving.load_state_dict(state["moving_reference"])
        for cb in trainer.callbacks:
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        if self.weight_sync_interval > 0:  # interval 0: the base weights the fresh sampler has are right
            if not state["sampler_holds_policy"]:
                log.warning(
                    "the checkpoint was taken between weight syncs; "
                    "the sampler restarts from the saved policy (not an exact resume)"
                )
            self.sync_sampler(module, self.datamodule.version)  # the saved policy is that version
        self._rng_to_restore = state["rng"]
        self._replay_history_into_csv(trainer)
        log.info("resumed from %s at step %d", self.resume_from, state["step"])
        max_steps = self.datamodule.stream.max_steps
        if trainer.is_global_zero and 0 < max_steps <= state["step"]:
            log.warning(
                "the checkpoint is at step %d and max_steps=%d: there is nothing left to train, no step will run "
                "(raise max_steps to train on)",
                state["step"],
                max_steps,
            )

    def before_step(self) -> None:
        """At each batch start; after a resume, the RNG states go back as late as possible:
        Lightning draws from torch's RNG when it makes the dataloader iterator."""
        if self._rng_to_restore is not None:
            restore_rng(self._rng_to_restore)
            self._rng_to_restore = None

    def on_train_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        """A last checkpoint and a last evaluation, unless the last step just had them; how many
        samples scored `reward.timeout_reward` in place of their reward, if any did."""
        self._say_reward_timeouts(trainer)
        step = module.rollout_step
        if self.checkpointer is not None and self.checkpointer.due_at_end(trainer, step):
            self._save(trainer, module, step)
        for evaluator in self.evaluators:
            if step > 0 and evaluator.last_step != step and not self.stopping:
                if metrics := evaluator.evaluate(step, trainer.global_rank, trainer.world_size):
                    for logger in trainer.loggers:
                        logger.log_metrics(metrics, step=step - 1)

    def _evaluate_at_start(self, trainer: L.Trainer) -> None:
        """A fresh run's evaluation before its first step (`eval_at_start`), logged at step 0."""
        for evaluator in self.evaluators:
            if (at_start := getattr(evaluator, "evaluate_at_start", None)) is not None:
                if metrics := at_start(trainer.global_rank, trainer.world_size):
                    for logger in trainer.loggers:
                        logger.log_metrics(metrics, step=0)

    def _say_reward_timeouts(self, trainer: L.Trainer) -> None:
        """One line with every rank's count of substituted rewards (a collective; none without a scorer)."""
        scorer = getattr(self.datamodule, "reward_scorer", None)
        if scorer is None:
            return
        timed_out, samples = all_reduce(torch.tensor([float(scorer.timed_out), float(scorer.samples)])).tolist()
        if timed_out and trainer.is_global_zero:
            log.warning("%s", scorer.timeout_summary(int(timed_out), int(samples)))

    def _replay_history_into_csv(self, trainer: L.Trainer) -> None:
        """Lightning's CSV logger starts a fresh metrics.csv; write the restored steps back into it."""
        for logger in trainer.loggers:
            if isinstance(logger, CSVLogger):
                for step, metrics in enumerate(self.history.steps):
                    logger.log_metrics(metrics, step=step)
                logger.save()

    # ------------------------------------------------------------------ what the run's summary reads

    def last_evaluation(self) -> dict[str, float]:
        """The latest metrics of every evaluator (greedy accuracy: `eval/accuracy`)."""
        return {k: v for e in self.evaluators for k, v in e.last_metrics.items()}

    def start_evaluation(self) -> dict[str, float]:
        """The metrics of the evaluation before the first step (`eval_at_start`; empty without one)."""
        return {k: v for e in self.evaluators for k, v in getattr(e, "start_metrics", {}).items()}

    @property
    def rows_exhausted(self) -> bool:
        """Whether the rows ran out before `max_steps`."""
        return self.datamodule.rows_exhausted

    @property
    def bad_rows(self):
        """This rank's rows whose own data could not be used (named once each; listed at the end)."""
        return self.datamodule.bad_rows

    @property
    def run_id(self) -> Optional[str]:
        """The id of the run's checkpoints (None without checkpoints)."""
        return self.checkpointer.run_id if self.checkpointer is not None else None

    def state_dict(self) -> dict:
        return {"history": self.history.state_dict(), "evaluators": [e.state_dict() for e in self.evaluators]}

    def load_state_dict(self, state: dict) -> None:
        self.history.load_state_dict(state["history"])
        # A checkpoint from before the evaluators were one list saved the greedy one alone, first.
        saved = state.get("evaluators", [state["evaluator"]] if state.get("evaluator") is not None else [])
        for evaluator, evaluator_state in zip(self.evaluators, saved):
            evaluator.load_state_dict(evaluator_state)
