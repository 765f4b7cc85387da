"""Train a policy with GRPO-family RL: `train(cfg)` plus a thin Hydra entry point.

    python -m lit_grpo.train +experiment=arithmetic                 # the CPU demo
    python -m lit_grpo.train +experiment=arithmetic trainer.fast_dev_run=true
    python -m lit_grpo.train -m +experiment=arithmetic policy_loss=grpo,dapo,gspo

The config is validated (and every field error reported by name) before any model is loaded.
"""

from __future__ import annotations

import json
import logging
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Optional

import hydra
import lightning as L
from hydra.utils import instantiate
from omegaconf import DictConfig

from lit_grpo.callbacks import GreedyEvaluation
from lit_grpo.callbacks.checkpoint import DCPCheckpoint
from lit_grpo.callbacks.export import HFExport
from lit_grpo.callbacks.history import MetricHistory
from lit_grpo.checkpoint import CheckpointStore, check_resumable, find_resume_checkpoint
from lit_grpo.config import ConfigError, TrainConfig, validate
from lit_grpo.data import RolloutDataModule
from lit_grpo.loggers import finish_runs
from lit_grpo.models import load_policy, load_tokenizer
from lit_grpo.module import GRPOModule, OptimConfig
from lit_grpo.preflight import check_sources
from lit_grpo.rollout import load_rollout_factory
from lit_grpo.samplers import build_sampler
from lit_grpo.tasks import build_eval_rows, build_rows, reward_fn
from lit_grpo.tasks.gsm8k_rows import RowError
from lit_grpo.types import RolloutSetup

log = logging.getLogger(__name__)
SUMMARY_WINDOW = 10
CONF_DIR = Path(__file__).resolve().parents[1] / "conf"

# Both are deliberate: the step pulls its own batch (no prefetch of stale rollouts), and the
# policy runs in eval mode (no dropout, so trainer and sampler logprobs agree).
warnings.filterwarnings("ignore", message=r".*`dataloader_iter`.*")
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
# A single-process run saves its DCP checkpoints without a process group, as intended.
warnings.filterwarnings("ignore", message=r".*torch.distributed is disabled, unavailable or uninitialized.*")


def build_module(c: TrainConfig, policy) -> GRPOModule:
    return GRPOModule(
        policy,
        loss_name=c.policy_loss.name,
        loss_hyperparams=c.policy_loss.hyperparams(),
        loss_normalization=c.policy_loss.loss_normalization,
        optim=OptimConfig(
            learning_rate=c.learning_rate, betas=(c.adam_beta1, c.adam_beta2), eps=c.adam_eps,
            weight_decay=c.weight_decay, warmup_steps=c.warmup_steps, grad_clip_norm=c.grad_clip_norm,
            lr_decay=c.lr_decay, total_steps=c.max_steps * c.ppo_n_minibatches,
        ),
        temperature=c.sampler.temperature,
        micro_batch_size=c.micro_batch_size,
        ppo_n_minibatches=c.ppo_n_minibatches,
    )


def build_datamodule(c: TrainConfig, policy, tokenizer, rows: Optional[list[dict]] = None, eval_rows: Optional[list[dict]] = None) -> RolloutDataModule:
    """The rollout data module (rows: the task's, loaded here unless given)."""
    sampler = build_sampler(c.sampler, policy, tokenizer, model=c.model, work_dir=c.output_dir, seed=c.seed)
    setup = RolloutSetup(
        sampler=sampler,
        tokenizer=tokenizer,
        sample_kwargs={"temperature": c.sampler.temperature, "max_tokens": c.sampler.max_completion_tokens, "top_p": 1.0, "top_k": 0},
        extras={"reward_fn": reward_fn(c.data), **c.rollout.extras},
    )
    return RolloutDataModule(
        rows=build_rows(c.data, c.seed) if rows is None else rows,
        eval_rows=build_eval_rows(c.data, c.seed) if eval_rows is None else eval_rows,
        reward_fn=setup.extras["reward_fn"],
        tokenizer=tokenizer,
        sampler=sampler,
        rollout_fn=load_rollout_factory(c.rollout.factory)(setup),
        completions_per_prompt=c.data.completions_per_prompt,
        prompt_groups_per_step=c.data.prompt_groups_per_step,
        epochs=c.data.epochs,
        seed=c.seed,
        shuffle=c.data.shuffle,
        advantage_scale=c.policy_loss.advantage_scale,
        max_steps=c.max_steps,
        max_seq_len=c.data.max_seq_len,
        min_group_size=c.data.min_group_size,
        synchronous_training=c.synchronous_training,
        max_head_offpolicy_versions=c.max_head_offpolicy_versions,
        max_concurrency=c.max_concurrency_rollout_sample,
    )


def _instantiate_all(group: dict) -> list[Any]:
    return [instantiate(spec) for spec in group.values() if spec is not None]


def run_callbacks(c: TrainConfig, tokenizer, resume_from: Optional[Path]) -> list[L.Callback]:
    """The callbacks made from the run's own config: DCP checkpoints / resume and the final export."""
    callbacks: list[L.Callback] = []
    if c.dcp_save_interval > 0 or resume_from is not None:
        callbacks.append(DCPCheckpoint(
            CheckpointStore(Path(c.output_dir) / "checkpoints", keep_last=c.dcp_keep_last), interval=c.dcp_save_interval,
            run_config=c, weight_sync_interval=c.weight_sync_interval, resume_from=resume_from,
        ))
    if c.output_model_id:
        callbacks.append(HFExport(Path(c.output_dir) / c.output_model_id, tokenizer))  # an absolute id stays absolute
    return callbacks


def build_trainer(c: TrainConfig, history: MetricHistory, extra_callbacks: list[L.Callback] = ()) -> L.Trainer:
    t = c.trainer
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=t.strategy,
        precision=t.precision,
        max_epochs=t.max_epochs,
        max_steps=-1,  # the rollout stream decides when training ends
        fast_dev_run=t.fast_dev_run,
        log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar,
        enable_model_summary=t.enable_model_summary,
        # Checkpoints are the DCP callback's job: Lightning adds no ModelCheckpoint beside it.
        enable_checkpointing=any(isinstance(cb, DCPCheckpoint) for cb in extra_callbacks),
        deterministic=t.deterministic,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=c.output_dir,
        callbacks=[*_instantiate_all(c.callbacks), history, *extra_callbacks],
        logger=_instantiate_all(c.logger) or False,
        **t.extra,
    )


def summarize(history: MetricHistory, metric: str, wall_s: float) -> dict[str, float]:
    """First/last/best `metric` (means over SUMMARY_WINDOW steps), step count and wall time."""
    values = history.series(metric)
    w = SUMMARY_WINDOW
    window_means = [sum(values[i : i + w]) / len(values[i : i + w]) for i in range(max(len(values) - w + 1, 1))] if values else []
    return {
        "steps": float(len(history.steps)),
        "first_reward": sum(values[:w]) / len(values[:w]) if values else float("nan"),
        "final_reward": sum(values[-w:]) / len(values[-w:]) if values else float("nan"),
        "best_reward": max(window_means) if window_means else float("nan"),
        "wall_s": wall_s,
    }


def fit(c: TrainConfig, resume_from: Optional[Path] = None) -> tuple[L.Trainer, MetricHistory]:
    """Seed, build the model, data and trainer from a validated config, and train (from `resume_from`'s state)."""
    L.seed_everything(c.seed, workers=True, verbose=False)
    # Data first: a malformed row or a missing file fails before a model is loaded.
    rows, eval_rows = build_rows(c.data, c.seed), build_eval_rows(c.data, c.seed)
    tokenizer = load_tokenizer(c.model)
    policy = load_policy(c.model, tokenizer, c.seed)
    datamodule = build_datamodule(c, policy, tokenizer, rows, eval_rows)
    module = build_module(c, policy)
    history = MetricHistory()
    trainer = build_trainer(c, history, run_callbacks(c, tokenizer, resume_from))
    try:
        trainer.fit(module, datamodule=datamodule)
    finally:
        datamodule.close()
        finish_runs(trainer.loggers)
    return trainer, history


def final_evaluation(trainer: L.Trainer) -> dict[str, float]:
    """The last `eval/accuracy` of the run (empty without evaluation)."""
    for cb in trainer.callbacks:
        if isinstance(cb, GreedyEvaluation) and cb.last:
            return {"eval_accuracy": cb.last["eval/accuracy"]}
    return {}


def _job_overrides() -> str:
    """The command-line overrides of this Hydra job (empty outside Hydra), for sweep tables."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return ""
    return " ".join(o for o in HydraConfig.get().overrides.task if not o.startswith(("output_dir", "hydra.")))


def train(cfg: DictConfig | TrainConfig) -> dict[str, float]:
    """Run one training job; returns (and writes to `<output_dir>/summary.json`) its summary."""
    c = validate(cfg)  # every field error surfaces here, before a model is touched
    check_sources(c)  # an unreachable model or dataset: one message in seconds, not a retry loop
    resume_from = find_resume_checkpoint(c.resume, c.output_dir)
    if resume_from is not None:
        check_resumable(resume_from, c)  # refused before a model is touched, too
    start = time.perf_counter()
    Path(c.output_dir).mkdir(parents=True, exist_ok=True)

    trainer, history = fit(c, resume_from)
    summary = summarize(history, c.summary_metric, time.perf_counter() - start)
    summary.update(final_evaluation(trainer))
    summary_file = {
        **summary, "overrides": _job_overrides(), "resumed_from": str(resume_from) if resume_from else None,
        "reward_curve": history.series(c.summary_metric),
    }
    if trainer.is_global_zero:
        (Path(c.output_dir) / "summary.json").write_text(json.dumps(summary_file, indent=1))
        log.info("run summary: %s", json.dumps(summary))
    return summary


def compose_config(overrides: list[str]) -> DictConfig:
    """The config `python -m lit_grpo.train <overrides>` runs, composed without the CLI (for scripts)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> float:
    try:
        return train(cfg)["final_reward"]
    except (ConfigError, RowError) as err:  # a config, data or environment problem: its message, not a traceback
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
