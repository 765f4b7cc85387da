"""Train a policy with GRPO-family RL: `train(cfg)` plus a thin Hydra entry point.

    python -m lit_grpo.train +experiment=arithmetic                 # the CPU demo
    python -m lit_grpo.train +experiment=arithmetic trainer.fast_dev_run=true
    python -m lit_grpo.train -m +experiment=arithmetic policy_loss=grpo,dapo,gspo

The config is validated (and every field error reported by name) before any model is loaded,
and before Lightning and transformers are imported: the run itself is `lit_grpo.build`'s.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from lit_grpo.config import ConfigError, TrainConfig, UserInputs, ineffective_knobs
from lit_grpo.config.keys import composition_error
from lit_grpo.config.moved import MOVED, rename_overrides
from lit_grpo.errors import EXIT_USER_ERROR, EnvironmentFault, run_cli, run_hydra_cli, user_message
from lit_grpo.loop.signals import STOP_SIGNALS, StopRequested, StopSignals, quiet_abandoned_work
from lit_grpo.run.checkpoint import check_resumable
from lit_grpo.run.console import stop_reason, tidy_lightning_logging
from lit_grpo.run.folder import claim_output_dir, find_resume_checkpoint, launched_as_rank_zero, set_aside_metrics
from lit_grpo.run.preflight import check_sources, discard_refused_run_dir
from lit_grpo.run.provenance import run_versions, warn_if_versions_differ, write_provenance
from lit_grpo.run.validate import validate
from lit_grpo.samplers.worker import run_threads

if TYPE_CHECKING:
    import lightning as L

    from lit_grpo.loop.metrics import MetricHistory
    from lit_grpo.loop.module import GRPOModule

log = logging.getLogger(__name__)
SUMMARY_WINDOW = 10
SUMMARY_FILE = "summary.json"
CONF_DIR = Path(__file__).resolve().parent / "conf"  # shipped in the package (the wheel carries it)


def summary_window(steps: int) -> int:
    """The steps each of the summary's means covers: SUMMARY_WINDOW, or half the run when it is
    shorter than two windows, so that the first and the final reward never share a step (a 10-step
    run is 5 and 5; one step is its own first, final and best)."""
    return max(1, min(SUMMARY_WINDOW, steps // 2))


def summarize(history: MetricHistory, metric: str, wall_s: float) -> dict[str, float]:
    """First/last/best `metric` (means over `summary_window` steps), step count and wall time."""
    values = history.series(metric)
    w = summary_window(len(values))
    window_means = (
        [sum(values[i : i + w]) / len(values[i : i + w]) for i in range(max(len(values) - w + 1, 1))] if values else []
    )
    return {
        "steps": float(len(history.steps)),
        "first_reward": sum(values[:w]) / len(values[:w]) if values else float("nan"),
        "final_reward": sum(values[-w:]) / len(values[-w:]) if values else float("nan"),
        "best_reward": max(window_means) if window_means else float("nan"),
        "wall_s": wall_s,
    }


def _job_overrides() -> str:
    """The command-line overrides of this Hydra job (empty outside Hydra), for sweep tables."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return ""
    return " ".join(o for o in HydraConfig.get().overrides.task if not o.startswith(("output_dir", "hydra.")))


def write_summary(
    c: TrainConfig,
    trainer: Optional[L.Trainer],
    module: Optional[GRPOModule],
    resume_from: Optional[Path],
    wall_s: float,
    stop: StopSignals,
) -> dict:
    """The run's summary, also written to `<output_dir>/summary.json` (with the reward curve) by rank 0:
    written beside it, then renamed into place, so a reader finds the earlier one or this one whole.
    `trainer` and `module` are None for a run stopped before it built them."""
    from lit_grpo.loop.metrics import MetricHistory

    sequence = module.step_sequence if module is not None else None
    history = sequence.history if sequence is not None else MetricHistory()
    summary: dict[str, Any] = dict(summarize(history, c.summary_metric, wall_s))  # numbers, and `stopped_by`
    if sequence is not None:
        # eval/accuracy -> eval_accuracy, eval/reward/<name> -> eval_reward_<name>; `_start`: before
        # the first step (`eval_at_start`)
        for suffix, metrics in (("_start", sequence.start_evaluation()), ("", sequence.last_evaluation())):
            for key, value in metrics.items():
                if key == "eval/accuracy" or key.startswith("eval/reward/"):
                    summary[key.replace("/", "_") + suffix] = value
    if stop.signum is not None:
        summary["stopped_by"] = signal.Signals(stop.signum).name
    rows_exhausted = sequence is not None and sequence.rows_exhausted
    if rows_exhausted:
        summary["rows_exhausted"] = 1.0  # the rows ran out before max_steps
    reason = stop_reason(
        steps=module.rollout_step if module is not None else 0,
        max_steps=c.max_steps,
        rows_exhausted=rows_exhausted,
        signum=stop.signum if stop.requested else None,
        fast_dev_run=bool(trainer.fast_dev_run) if trainer is not None else False,
    )
    summary_file = {
        **summary,
        "overrides": _job_overrides(),
        "resumed_from": str(resume_from) if resume_from else None,
        "run_id": sequence.run_id if sequence is not None else None,
        "stop_reason": reason,
        "versions": run_versions(c.sampler.kind),
        "reward_curve": (curve := history.series(c.summary_metric)),
        "reward_window": summary_window(len(curve)),
    }
    bad_rows = sequence.bad_rows if sequence is not None else None
    if bad_rows is not None and bad_rows.count:  # this rank's share: each rank says its own
        summary_file["bad_rows"] = {"count": bad_rows.count, "first": [{"row": r, "why": w} for r, w in bad_rows.first]}
        log.warning("%s", bad_rows.summary_line())
    if trainer.is_global_zero if trainer is not None else launched_as_rank_zero():
        path = Path(c.output_dir) / SUMMARY_FILE
        tmp = path.with_name(f".{SUMMARY_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(summary_file, indent=1))
        os.replace(tmp, path)
        window = summary_file["reward_window"]
        log.info(
            "run summary (first_reward, final_reward, best_reward: %s): %s",
            f"means over {window} steps" if window > 1 else "one step each",
            json.dumps(summary),
        )
        log.info("%s", reason)  # the run's last line: why it stopped
    return summary


def what_a_stop_wrote(c: TrainConfig, module: Optional[GRPOModule]) -> str:
    """For the stop's last line: what this stop left on disk, and what it did not (never more)."""
    checkpointer = module.step_sequence.checkpointer if module is not None and module.step_sequence else None
    saved = checkpointer.last_saved_step if checkpointer is not None else None
    written = [f"checkpoint step {saved}"] if saved else []
    if (Path(c.output_dir) / "metrics.csv").is_file():
        written.append("metrics")
    written.append("summary")
    missing = (
        "no checkpoint: checkpoints are off (checkpoint.save_interval=0)"
        if checkpointer is None and module is not None
        else "no checkpoint: no step had finished"
        if not saved
        else ""
    )
    said = (", ".join(written[:-1]) + " and " + written[-1] if len(written) > 1 else written[0]) + " written"
    return said + (f"; {missing}" if missing else "")


def train(cfg: DictConfig | TrainConfig, inputs: Optional[UserInputs] = None) -> dict[str, Any]:
    """Run one training job; returns (and writes to `<output_dir>/summary.json`) its summary.

    The stop signals are caught from the first line: one received while the config is checked, the
    libraries load or the run is built is honoured once it can be (before the build: the summary
    alone; after it: the step sequence's stop), and one received while the summary is written waits
    for it. Every stop of a run whose folder exists leaves its summary."""
    start = time.perf_counter()
    with StopSignals() as stop:
        c = validate(cfg)  # every field error surfaces here, before a model is touched
        if inputs is not None and inputs.reward_fn is not None and c.reward.specs():
            field, value = ("reward.fn", c.reward.fn) if c.reward.fn else ("reward.model", c.reward.model)
            raise ConfigError(
                f"config field `{field}`: {value!r} and a reward_fn given in Python both name the reward; keep one"
            )
        for note in ineffective_knobs(c):
            log.warning(note)
        check_sources(c)  # an unreachable model or dataset: one message in seconds, not a retry loop
        with claim_output_dir(c.output_dir):  # held to the end: a second run on this folder is refused at once
            resume_from = find_resume_checkpoint(c.resume, c.output_dir)  # or refused, saying what the folder holds
            if resume_from is not None:
                check_resumable(resume_from, c)  # refused before a model is touched, too
            set_aside_metrics(c.output_dir, resume_from)  # an earlier run's metrics.csv survives a fresh start
            if launched_as_rank_zero():
                write_provenance(c, resume_from)  # what the run runs on, written first: a crashed run has it too
            if resume_from is not None:
                warn_if_versions_differ(resume_from, run_versions(c.sampler.kind))
            # torch, Lightning and transformers load here, once the inputs are known good
            from lit_grpo.build import fit

            tidy_lightning_logging()  # each line once, no advertisement, no misleading stop line
            trainer = module = None
            if not stop.requested:  # else stopped before a model was built: the summary says so
                try:
                    trainer, module = fit(c, resume_from, stop=stop, inputs=inputs)
                except Exception as err:
                    from lit_grpo.loop.peers import explain_lost_peer  # loads torch: here, once a run was built

                    if (lost := explain_lost_peer(err)) is not None:  # a collective failed: a peer went away
                        log.error("stopped: PeerLost (its message follows)")
                        raise lost from None
                    log.error(
                        "stopped: %s (%s)",
                        type(err).__name__,
                        "its message follows" if user_message(err) else "a bug: its traceback follows",
                    )
                    raise
            summary = write_summary(c, trainer, module, resume_from, time.perf_counter() - start, stop)
            for problem in (getattr(cb, "problem", None) for cb in (trainer.callbacks if trainer is not None else [])):
                if problem:  # the export failed: the summary is written, the policy saved where it says
                    raise EnvironmentFault(problem)
            if stop.signum is not None:  # after the summary and the metrics are written, saying what was
                raise StopRequested(stop.signum, what_a_stop_wrote(c, module))
    return summary


def compose_config(overrides: list[str]) -> DictConfig:
    """The config `python -m lit_grpo.train <overrides>` runs, composed without the CLI (for scripts)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=rename_overrides(list(overrides)))


def _signal_after_the_end(signum: int, frame) -> None:
    print(
        f"{signal.Signals(signum).name} after the run ended: nothing left to stop, its summary is written",
        file=sys.stderr,
        flush=True,
    )
    logging.shutdown()
    os._exit(128 + signum)


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float:
    try:
        # A config, data, rollout or environment problem: its message and exit code 2, no traceback
        # (HYDRA_FULL_ERROR=1 shows it); a bug keeps its traceback.
        try:
            final_reward = float(run_cli(train, cfg)["final_reward"])
        except SystemExit as refused:
            if refused.code == EXIT_USER_ERROR:  # before the run started: no folder of Hydra's files left behind
                discard_refused_run_dir(f"{HydraConfig.get().job.name}.log")
            raise
        for signum in STOP_SIGNALS:  # the run is over and its summary written: a late signal only ends the process
            cli_stop = getattr(signal.signal(signum, _signal_after_the_end), "__self__", None)
        if isinstance(cli_stop, StopSignals) and cli_stop.signum is not None:  # it came as `train` returned
            _signal_after_the_end(cli_stop.signum, None)
        return final_reward
    except StopRequested as stop:  # non-zero, so that a preempting scheduler requeues the job
        quiet_abandoned_work()
        print(stop.report(), file=sys.stderr)
        sys.exit(128 + stop.signum)


def exit_past_stuck_threads(code: int, wait_s: float = 5.0) -> None:
    """The last resort of a clean exit: every thread a run starts is stopped and joined when it ends
    (bounded), but one stuck in an engine call that never returns is abandoned, and the interpreter
    tearing torch down under it can abort the process (SIGABRT, "terminate called without an active
    exception") after the run finished. If any is still alive `wait_s` after the run, the process
    exits here with `code` (logs and output flushed, atexit handlers skipped)."""
    peers = sys.modules.get("lit_grpo.loop.peers")  # loaded by a distributed run only
    if peers is not None and peers.lost_a_peer():
        # The process group is broken: finalizing it (gloo's threads, a store call in flight) was
        # seen to abort the process (SIGABRT) after the stop's message. Nothing is left to write.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    deadline = time.monotonic() + wait_s
    while (left := run_threads()) and time.monotonic() < deadline:
        left[0].join(max(deadline - time.monotonic(), 0.0))
    if left := run_threads():
        # After a stop the error already said why (a blocked loop, a stuck engine): its line stays the last.
        log.log(
            logging.WARNING if code == 0 else logging.DEBUG,
            "threads still running after the run ended (%s): exiting with status %d without waiting for them",
            ", ".join(t.name for t in left),
            code,
        )
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def cli() -> None:
    """The `lit-grpo` console command: exactly `python -m lit_grpo.train` (Hydra's CLI included)."""
    # Caught from the process's start, never restored: a stop while Hydra sets up is `train`'s stop
    # (its summary alone); after the run, `main` hands the handlers to `_signal_after_the_end`.
    StopSignals().__enter__()
    # torch's C++ warnings print their stack frames (a lost peer's store or collective call does,
    # before Python sees the error the stop's message explains): off unless asked for. It is read
    # at torch's first C++ log line, so here, before any collective.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    # Old key names: one line each, then their new names; an old and a new name at odds: exit 2.
    sys.argv[1:] = run_cli(rename_overrides, sys.argv[1:])
    try:
        run_hydra_cli(main, explain=lambda err: composition_error(err, TrainConfig, MOVED))
    except SystemExit as stop:
        exit_past_stuck_threads(0 if stop.code is None else stop.code if isinstance(stop.code, int) else 1)
        raise
    exit_past_stuck_threads(0)


if __name__ == "__main__":
    cli()
