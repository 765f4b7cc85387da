"""lit_grpo: GRPO-family reinforcement learning of language models on PyTorch Lightning.

The package, by job, lowest layer first (`LAYERS`; a module imports only from its own layer or
below, function-level imports included, and `tests/test_layers.py` holds it to that):

    types, errors, registry   the public data types, user errors, registry name lookup
    config/      the dataclasses of every config group (bounds and types only)
    maths/       losses, mismatch correction, entropy, logprobs, health signals: pure tensor functions
    advantages/  the advantage estimators (grpo, rloo, ..., IGPO) and `compute`: pure functions too
    models/      the policy built or loaded, LoRA, its full weights for a sampler
    samplers/    one protocol: hf, vllm in-process; samplers/server/, the vLLM server wing
    rewards/     the reward registry and the run's weighted reward
    tasks/       the task registry and the rows a run reads
    rollouts/    rows to training batches: rollout function, cursor, schedulers, checks, data module
    envs/        multi-turn environments (the lookup game, the calculator tool)
    run/         validation and preflight, the run folder, checkpoints, export, loggers, sweeps
    loop/        GRPOModule, the step sequence, metrics, evaluation, signals
    callbacks/   optional extras as Lightning callbacks
    build        a validated config into trainer, module and data module
    train, serve, export   the entry points: `python -m lit_grpo.train`, `lit_grpo.serve`, `lit_grpo.export`
    cookbook/    the cookbook's Python surface (`Config`, `main`) on top of `train`
"""

from lit_grpo.types import Completion, PromptGroup, RolloutBatch, RolloutSample, RolloutSetup, Sampler

LAYERS = (
    ("lit_grpo", "lit_grpo.types", "lit_grpo.errors", "lit_grpo.registry"),
    ("lit_grpo.config",),
    ("lit_grpo.maths", "lit_grpo.advantages"),
    ("lit_grpo.models",),
    ("lit_grpo.samplers",),
    ("lit_grpo.rewards",),
    ("lit_grpo.tasks",),
    ("lit_grpo.rollouts",),
    ("lit_grpo.envs",),
    ("lit_grpo.run",),
    ("lit_grpo.loop",),
    ("lit_grpo.callbacks",),
    ("lit_grpo.build",),
    ("lit_grpo.train", "lit_grpo.serve", "lit_grpo.export"),
    ("lit_grpo.cookbook",),
)
"""The package's wings, lowest first; `lit_grpo.conf` (Hydra's YAML tree) holds no code."""

__all__ = ["LAYERS", "Completion", "PromptGroup", "RolloutBatch", "RolloutSample", "RolloutSetup", "Sampler"]
__version__ = "0.1.0"
