"""A validated config into this rank's trainer, module and rollout data module, and their fit.

    trainer, module, datamodule = build_run(c)     # the pieces, for a caller that drives them
    trainer, module = fit(c)                       # built and trained (what `lit_grpo.train.train` runs)

Lightning, transformers and the samplers are imported here, not by `lit_grpo.train`, so that the
command line refuses a bad config, a missing file or an unusable output folder in about 3 s
instead of 8, before they load (the config's checks need torch, for the loss registry).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import warnings
from collections.abc import Sequence
from datetime import timedelta
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
from hydra.utils import instantiate
from lightning.pytorch.strategies import DDPStrategy, StrategyRegistry
from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import nn

from lit_grpo.advantages.registry import Advantage, get_advantage, make_advantage
from lit_grpo.callbacks.export import HFExport
from lit_grpo.callbacks.progress import StepLogLine, StepProgressBar
from lit_grpo.config import ConfigError, ModelConfig, TrainConfig, UserInputs
from lit_grpo.config.checks import exception_class
from lit_grpo.config.guards import GuardsConfig
from lit_grpo.loop.distributed import FSDP2Strategy, WatchedDDPStrategy
from lit_grpo.loop.evaluation import Evaluator, GreedyEvaluator, RolloutEvaluator
from lit_grpo.loop.module import GRPOModule
from lit_grpo.loop.peers import PeerWatchCallback
from lit_grpo.loop.signals import StopSignals
from lit_grpo.loop.step_sequence import StepSequence
from lit_grpo.models.load import (
    load_policy,
    load_processor,
    load_tokenizer,
    save_pretrained,
    set_cpu_threads,
    with_resolved_model,
)
from lit_grpo.models.lora import adapter_config, adapter_tensors, base_tensors, is_lora, with_lora
from lit_grpo.models.weights import full_named_tensors
from lit_grpo.rewards.combine import component_names, part_key
from lit_grpo.rewards.scoring import RewardScorer
from lit_grpo.rollouts.datamodule import RolloutDataModule
from lit_grpo.rollouts.rollout import built_rollout_fn, load_rollout_factory
from lit_grpo.run.checkpoint import CheckpointStore
from lit_grpo.run.loggers import finish_runs
from lit_grpo.run.peak import bf16_emulated_on_cpu
from lit_grpo.run.state import RunCheckpointer
from lit_grpo.samplers import StartingWeights, build_sampler
from lit_grpo.samplers.base import BatchingSampler
from lit_grpo.tasks import RewardFn, evaluation_rows, reward_fn, training_rows
from lit_grpo.tasks.images import image_placeholder_ids
from lit_grpo.types import RolloutSetup

log = logging.getLogger(__name__)

RESCUED_MODEL_DIR = "exported_policy"
"""Where, in the run folder, the trained policy goes when `output_model_id` cannot be written."""

# Both are deliberate: the step pulls its own batch (no prefetch of stale rollouts), and the
# policy runs in eval mode (no dropout, so trainer and sampler logprobs agree).
warnings.filterwarnings("ignore", message=r".*`dataloader_iter`.*")
warnings.filterwarnings("ignore", message=r".*module\(s\) in eval mode.*")
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")
# A single-process run saves its DCP checkpoints without a process group, as intended.
warnings.filterwarnings("ignore", message=r".*torch.distributed is disabled, unavailable or uninitialized.*")


# Rank r samples from its own stream: the ranks' completions must differ, as their rows do.
RANK_SEED_STRIDE = 1_000_003


def build_datamodule(
    c: TrainConfig,
    policy,
    tokenizer,
    rows: list[dict],
    reward: RewardFn,
    *,
    rank: int = 0,
    world_size: int = 1,
    inputs: Optional[UserInputs] = None,
) -> RolloutDataModule:
    """The rollout data module of this rank: its share of `rows`, its own sampler and rollout function."""
    inputs = inputs or UserInputs()
    sampler_cfg, work_dir = c.sampler, c.output_dir
    if world_size > 1:  # each rank's sampler writes its own files, and owns its own servers
        work_dir = str(Path(c.output_dir) / f"rank{rank}")
        if c.sampler.server_urls:
            if len(c.sampler.server_urls) < world_size:
                raise ConfigError(
                    f"config field `sampler.server_urls`: {len(c.sampler.server_urls)} servers cannot be shared "
                    f"out to {world_size} ranks (each rank syncs its own servers); give at least one per rank"
                )
            sampler_cfg = dataclasses.replace(c.sampler, server_urls=list(c.sampler.server_urls[rank::world_size]))
    processor = load_processor(c.model, tokenizer)  # a vision-language policy's (None: text)
    sampler = build_sampler(
        sampler_cfg,
        starting_weights(policy, tokenizer, c.model, processor),
        tokenizer,
        work_dir=work_dir,
        seed=c.seed + RANK_SEED_STRIDE * rank,
        share_weights=c.sampler_shares_policy_weights,
    )
    scorer = run_reward_scorer(c, reward)
    if isinstance(sampler, BatchingSampler):  # its `score` takes no images: it refuses their placeholders
        sampler.image_token_ids = image_placeholder_ids(processor)
    setup = RolloutSetup(
        sampler=sampler,
        tokenizer=tokenizer,
        sample_kwargs={
            "temperature": c.sampler.temperature,
            "max_tokens": c.sampler.max_completion_tokens,
            "top_p": 1.0,
            "top_k": 0,
        },
        extras={
            "reward_fn": reward,
            "reward_scorer": scorer,
            "prompt_field": c.data.prompt_field,
            "retry_on": tuple(exception_class(name) for name in c.guards.rollout_retry_on),
            "max_retries": c.guards.rollout_max_retries,
            **c.rollout.extras,
            **inputs.rollout_extras,
        },
        completions_per_prompt=c.data.completions_per_prompt,
        model=c.model.name_or_path or c.model.kind,
        tokenizer_id=c.model.name_or_path or c.model.kind,
        processor=processor,
    )
    datamodule = RolloutDataModule(
        c,
        rows=rows,
        tokenizer=tokenizer,
        sampler=sampler,
        rollout_fn=built_rollout_fn(
            inputs.rollout_factory or load_rollout_factory(c.rollout.factory),
            setup,
            "the Python caller's rollout factory" if inputs.rollout_factory else repr(c.rollout.factory),
        ),
        advantage=run_advantage(c),
        rank=rank,
        world_size=world_size,
    )
    datamodule.reward_scorer = scorer  # what the step sequence counts the reward's timeouts from
    return datamodule


def starting_weights(policy, tokenizer, model: Optional[ModelConfig] = None, processor=None) -> StartingWeights:
    """What a sampler's builder reads of the policy it starts from (`StartingWeights`): the
    policy, where it was loaded from (`model`: its config; None, or a model built here: nowhere),
    and its weights, full, base or adapter, or written as a Hugging Face folder (with `processor`,
    a vision-language policy's, which an engine reads the images with; else the tokenizer)."""
    lora = is_lora(policy)
    saved_with = processor or tokenizer

    def write_folder(out_dir: Path, tensors) -> Path:
        saved = policy.get_base_model() if lora else policy
        return save_pretrained(saved, saved_with, out_dir, state_dict=None if tensors is None else dict(tensors))

    return StartingWeights(
        policy=policy,
        loaded_from=model.name_or_path if model is not None and model.kind == "hf" else None,
        lora_rank=adapter_config(policy).r if lora else 0,
        full_tensors=lambda: full_named_tensors(policy),
        base_tensors=lambda: base_tensors(policy.state_dict().items()),
        adapter=lambda: (adapter_tensors(policy.state_dict().items()), adapter_config(policy)),
        write_folder=write_folder,
    )


def run_advantage(c: TrainConfig) -> Advantage:
    """The run's advantage estimator; one that reads reward components (gdpo) gets the metric keys
    of `reward.fn`'s components (a single reward: none, it reads the run's reward) and, unless
    `advantage.params.weights` is set, `reward.weights`."""
    if not get_advantage(c.advantage.name).components:
        return make_advantage(c.advantage.name, c.advantage.params)
    names = component_names(c.reward.specs())
    params = dict(c.advantage.params)
    if len(names) > 1:
        params.setdefault("weights", c.reward.weights)
    else:
        params.pop("weights", None)  # one column, the run's (already weighted) reward
    keys = [part_key(n) for n in names] if len(names) > 1 else []
    return make_advantage(c.advantage.name, params, keys)


def _instantiate_all(group: dict) -> list[Any]:
    return [instantiate(spec) for spec in group.values() if spec is not None]


def build_step_sequence(
    c: TrainConfig,
    datamodule: RolloutDataModule,
    resume_from: Optional[Path],
    stop: Optional[StopSignals] = None,
    inputs: Optional[UserInputs] = None,
    eval_rows: Optional[list[dict]] = None,
    reward: Optional[RewardFn] = None,
    saved_config: Optional[TrainConfig] = None,
) -> StepSequence:
    """Weight sync, checkpoints (and the resume) and evaluation, as the run's config sets them;
    checkpoints hold `saved_config` (the config as the user gave it), else `c`."""
    checkpointer = None
    if c.checkpoint.save_interval > 0 or resume_from is not None:
        store = CheckpointStore(Path(c.output_dir) / "checkpoints", keep_last=c.checkpoint.keep_last)
        checkpointer = RunCheckpointer(store, interval=c.checkpoint.save_interval, run_config=saved_config or c)
    return StepSequence(
        datamodule,
        weight_sync_interval=c.offpolicy.weight_sync_interval,
        checkpointer=checkpointer,
        evaluators=tuple(evaluators(c, datamodule, eval_rows or [], reward, inputs)),
        resume_from=resume_from,
        log_every_n_steps=c.trainer.log_every_n_steps,
        stop=stop,
    )


def run_reward_scorer(c: TrainConfig, reward: RewardFn) -> RewardScorer:
    """The run's reward under `reward.max_concurrency`, `reward.timeout_s` and `reward.max_timeout_share`
    (`lit_grpo.rewards.scoring`)."""
    r = c.reward
    return RewardScorer(
        reward,
        max_concurrency=r.max_concurrency,
        timeout_s=r.timeout_s,
        timeout_reward=r.timeout_reward,
        max_timeout_share=r.max_timeout_share,
    )


def evaluators(
    c: TrainConfig,
    datamodule: RolloutDataModule,
    eval_rows: list[dict],
    reward: Optional[RewardFn],
    inputs: Optional[UserInputs],
) -> list[Evaluator]:
    """Greedy accuracy on the held-out rows, then the Python caller's `evaluation_fn` (when given)."""
    found: list[Evaluator] = [
        GreedyEvaluator(
            datamodule.sampler,
            datamodule.tokenizer,
            eval_rows if reward is not None else [],
            run_reward_scorer(c, reward) if reward is not None else None,
            interval=c.eval_interval,
            max_tokens=c.sampler.max_completion_tokens,
            batch_size=c.sampler.max_batch_size,
            prompt_field=c.data.prompt_field,
            processor=load_processor(c.model, datamodule.tokenizer),
            at_start=c.eval_at_start,
        )
    ]
    if inputs is not None and inputs.evaluation_fn is not None:
        found.append(
            RolloutEvaluator(
                inputs.evaluation_fn,
                datamodule.groups.rollout_fn,
                interval=inputs.evaluation_interval,
                timeout_s=inputs.evaluation_timeout_s,
            )
        )
    return found


def build_strategy(name: str, guards: GuardsConfig) -> Any:
    """Lightning's strategy `name` (or `fsdp2`), with the process group's timeout for the strategies
    that start one (DDP's and FSDP2's), and lit_grpo's watch over the other local ranks
    (`WatchedLauncher`) when the peer watch is on; any other name as given."""
    timeout = timedelta(seconds=guards.collective_timeout_s)
    if name == "fsdp2":
        strategy: Any = FSDP2Strategy(timeout=timeout)
    elif name in StrategyRegistry and issubclass(StrategyRegistry[name]["strategy"], DDPStrategy):
        entry = StrategyRegistry[name]
        kind = WatchedDDPStrategy if entry["strategy"] is DDPStrategy else entry["strategy"]
        strategy = kind(**{**entry["init_params"], "timeout": timeout})
    else:
        return name
    strategy.watch_children = guards.peer_timeout_s > 0
    return strategy


def build_trainer(c: TrainConfig, extra_callbacks: Sequence[L.Callback] = ()) -> L.Trainer:
    t = c.trainer
    return L.Trainer(
        accelerator=t.accelerator,
        devices=t.devices,
        strategy=build_strategy(t.strategy, c.guards),
        precision=t.precision,
        max_epochs=t.max_epochs,
        max_steps=-1,  # the rollout stream decides when training ends
        fast_dev_run=t.fast_dev_run,
        log_every_n_steps=t.log_every_n_steps,
        enable_progress_bar=t.enable_progress_bar,
        enable_model_summary=t.enable_model_summary,
        enable_checkpointing=False,  # checkpoints are the step sequence's (DCP), not Lightning's ModelCheckpoint
        deterministic=t.deterministic,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        default_root_dir=c.output_dir,
        callbacks=[
            *_instantiate_all(c.callbacks),
            *extra_callbacks,
            PeerWatchCallback(c.guards.peer_heartbeat_s, c.guards.peer_timeout_s),
        ]
        + ([StepProgressBar(c.max_steps)] if t.enable_progress_bar else [StepLogLine(c.max_steps, c.summary_metric)]),
        logger=_instantiate_all(c.logger) or False,
        **t.extra,
    )


def build_run(
    c: TrainConfig,
    *,
    rows: Optional[list[dict]] = None,
    eval_rows: Optional[list[dict]] = None,
    resume_from: Optional[Path] = None,
    extra_callbacks: Sequence[L.Callback] = (),
    stop: Optional[StopSignals] = None,
    inputs: Optional[UserInputs] = None,
) -> tuple[L.Trainer, GRPOModule, RolloutDataModule]:
    """Seed, then build the model, the trainer (which knows this process's rank), this rank's data and the module."""
    L.seed_everything(c.seed, workers=True, verbose=False)
    # Data first: a malformed row or a missing file fails before a model is loaded. Rows given
    # here come before data.path, which comes before the task's rows; all are kept as stored.
    if inputs is not None:
        rows = rows if rows is not None else inputs.rows
        eval_rows = eval_rows if eval_rows is not None else inputs.eval_rows
    rows = training_rows(c, rows)
    eval_rows = evaluation_rows(c, eval_rows)
    # The reward before the policy: a reward model that cannot be loaded fails before the policy loads.
    reward = (inputs.reward_fn if inputs is not None else None) or reward_fn(c)
    # A GGUF file or a model built without the hub: every reader (samplers, vLLM, export) gets its folder;
    # checkpoints keep the name as given, which a resume compares with the config it is given.
    given, c = c, dataclasses.replace(c, model=with_resolved_model(c.model))
    tokenizer = load_tokenizer(c.model)
    policy: nn.Module = load_policy(c.model, tokenizer, c.seed)  # the same on every rank
    set_cpu_threads(c.trainer.cpu_threads, policy, engine_in_process=c.sampler.kind == "vllm")
    if c.adapter_sync:  # the sampler serves (or copies) its adapter from the start (the module adds none twice)
        policy = with_lora(policy, c.model.lora, c.seed)
    saved_with = load_processor(c.model, tokenizer) or tokenizer
    callbacks = (
        # A vision-language policy's folder holds its processor (the tokenizer with it), so it loads with AutoProcessor.
        [HFExport(Path(c.output_dir) / c.output_model_id, saved_with, Path(c.output_dir) / RESCUED_MODEL_DIR)]
        if c.output_model_id
        else []
    )  # an absolute id stays absolute
    trainer = build_trainer(c, [*callbacks, *extra_callbacks])
    if trainer.is_global_zero:
        log.info("%s", run_mode_line(c))
        if trainer.strategy.root_device.type == "cpu" and (slow := bf16_on_cpu_problem(c)) is not None:
            log.warning("%s", slow)
        if (short := completion_room_problem(c, rows, tokenizer)) is not None:
            log.warning("%s", short)
    L.seed_everything(c.seed + RANK_SEED_STRIDE * trainer.global_rank, verbose=False)
    datamodule = build_datamodule(
        c, policy, tokenizer, rows, reward, rank=trainer.global_rank, world_size=trainer.world_size, inputs=inputs
    )
    if inputs is not None and inputs.group_filter is not None:
        datamodule.add_group_filter(inputs.group_filter)
    sequence = build_step_sequence(c, datamodule, resume_from, stop, inputs, eval_rows, reward, saved_config=given)
    module = GRPOModule(policy, c, sequence)
    return trainer, module, datamodule


def run_mode_line(c: TrainConfig) -> str:
    """The one line a run starts with about how it runs: the policy's number format and the
    trainer's, and whether sampling overlaps training (and on what weights)."""
    policy = c.model.name_or_path or f"model.kind={c.model.kind}"
    precision = f"{policy} in {c.model.dtype} (model.dtype), trainer.precision={c.trainer.precision}"
    if c.offpolicy.synchronous:
        how = (
            "the hf sampler generates with the policy itself"
            if c.sampler_shares_policy_weights
            else f"the {c.sampler.kind} sampler generates"
        )
        mode = f"synchronous (offpolicy.synchronous=true): {how}, then the trainer trains, in turn"
    else:
        copy = " on a copy of the weights" if c.sampler.kind == "hf" else ""
        mode = (
            f"asynchronous (offpolicy.synchronous=false): the {c.sampler.kind} sampler generates the next rows{copy} "
            "while the trainer trains, so perf/sample_s overlaps perf/train_s (perf/overlap_ratio says how much); "
            "offpolicy.synchronous=true alternates them"
        )
    return f"{precision}; training is {mode}"


def bf16_on_cpu_problem(c: TrainConfig, flags: Optional[set[str]] = None) -> Optional[str]:
    """A warning for a CPU run in bfloat16 (`model.dtype` or `trainer.precision`) on a CPU without
    bfloat16 units (`lit_grpo.run.peak.bf16_emulated_on_cpu`; `flags`: the CPU's, else read)."""
    uses = [
        name
        for name, value in (("model.dtype", str(c.model.dtype)), ("trainer.precision", str(c.trainer.precision)))
        if "bf16" in value or "bfloat16" in value
    ]
    why = bf16_emulated_on_cpu(flags) if uses else None
    if why is None:
        return None
    verb = "ask" if len(uses) > 1 else "asks"
    faster = "model.dtype=float32 trainer.precision=32-true is faster here"
    return f"{' and '.join(uses)} {verb} for bfloat16, but {why}; {faster}"


PROMPT_ROWS_CHECKED = 256
"""The rows whose prompt lengths the start of a run checks against `data.max_seq_len`."""


def completion_room_problem(c: TrainConfig, rows: list[dict], tokenizer) -> Optional[str]:
    """A warning when the longest prompt of the first rows leaves less than
    `sampler.max_completion_tokens` within `data.max_seq_len` (None when all fit, or the rows'
    prompts are a custom rollout's to read)."""
    from lit_grpo.rollouts.rollout import row_prompt_tokens
    from lit_grpo.tasks.rows import DEFAULT_ROLLOUT

    if c.rollout.factory != DEFAULT_ROLLOUT or c.model.kind == "tiny_vlm":
        return None
    try:
        longest = max(len(row_prompt_tokens(row, tokenizer, c.data.prompt_field)) for row in rows[:PROMPT_ROWS_CHECKED])
    except Exception:  # a row the rollout will refuse, with its own message
        return None
    room = c.data.max_seq_len - longest
    if room >= c.sampler.max_completion_tokens:
        return None
    limit, wanted = c.sampler.max_completion_tokens, longest + c.sampler.max_completion_tokens
    checked = min(len(rows), PROMPT_ROWS_CHECKED)
    return (
        f"data.max_seq_len={c.data.max_seq_len} leaves {max(room, 0)} tokens for a completion after the longest "
        f"prompt of the first {checked} rows ({longest} tokens, chat template included), less than "
        f"sampler.max_completion_tokens={limit}: completions are cut there. Raise data.max_seq_len to {wanted} or more"
    )


def fit(c: TrainConfig, resume_from: Optional[Path] = None, **build_kwargs) -> tuple[L.Trainer, GRPOModule]:
    """Build a run from a validated config and train it (from `resume_from`'s state)."""
    threads = torch.get_num_threads()  # the run may set its own (`set_cpu_threads`): put back at its end
    trainer, module, datamodule = build_run(c, resume_from=resume_from, **build_kwargs)
    # The models, tokenizer and libraries are built: a full collection every few thousand new
    # objects (each step makes thousands) would walk all of them again, milliseconds a step.
    gc.collect()
    gc.freeze()
    try:
        trainer.fit(module, datamodule=datamodule)
    except SIGTERMException:  # Lightning's own end of a run that got SIGTERM
        if module.step_sequence is None or not module.step_sequence.stop.requested:
            raise  # no stop handlers installed (fit called outside `train`): nothing was saved for it
    finally:
        gc.unfreeze()  # a process that fits again (tests, sweeps) can free this run's objects
        datamodule.close()
        finish_runs(trainer.loggers)
        torch.set_num_threads(threads)
    return trainer, module
