"""The Lightning `Trainer` arguments a run exposes (`trainer=cpu|gpu`, `conf/trainer/`), checked
before anything loads: a value Lightning would refuse only once the model is built is named here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from lit_grpo.config.checks import require

PRECISIONS = (
    "64-true", "64", "32-true", "32", "16-mixed", "16", "bf16-mixed", "bf16", "16-true", "bf16-true",
    "transformer-engine", "transformer-engine-float16",
)  # fmt: skip
"""What `lightning.Trainer(precision=...)` accepts (Lightning 2.x's `_PRECISION_INPUT_STR`)."""
FSDP2_PRECISIONS = ("32-true", "32", "bf16-mixed", "bf16-true", "16-true")
"""What Lightning's ModelParallelStrategy (trainer.strategy=fsdp2) accepts."""
ACCELERATORS = ("auto", "cpu", "gpu", "cuda", "mps", "tpu")
"""Lightning's accelerator names (whether this machine has one is checked in `lit_grpo.run.validate`)."""
SMALL_MODEL_PARAMS = 20_000_000
"""Below this many parameters a run takes one torch thread unless `trainer.cpu_threads` or `OMP_NUM_THREADS` says
otherwise (docs/results.md, "Torch threads", has the measurements)."""


@dataclass
class LightningTrainerConfig:
    """Arguments of `lightning.Trainer` that lit_grpo exposes; `extra` passes any other one."""

    accelerator: str = "auto"
    """`auto`, `cpu`, or `gpu`/`cuda` (refused before anything loads on a machine without one)."""
    devices: Any = 1
    """Devices of `accelerator` to run on (a number, a list of indices, or `auto`); one process each."""
    strategy: str = "auto"
    """Any Lightning strategy name (`auto`, `ddp`, ...), or `fsdp2`: the policy and the reference
    sharded per decoder layer with FSDP2 (Lightning's `ModelParallelStrategy`; GPUs or CPUs)."""
    precision: str = "32-true"
    """A Lightning precision (`PRECISIONS`): `32-true`, `bf16-mixed`, `16-mixed`, `bf16-true`, ..."""
    max_epochs: int = 1
    """One Lightning epoch is the whole rollout stream (all data epochs)."""
    fast_dev_run: Any = False
    """True or N: run 1 (or N) steps as a smoke test, no checkpoints, no plots."""
    log_every_n_steps: int = 1
    """Hand the loggers a step's metrics every N rollout steps."""
    enable_progress_bar: bool = True
    """Lightning's progress bar, with the step's reward."""
    enable_model_summary: bool = False
    """Lightning's table of the policy's layers and parameter counts at the start."""
    deterministic: bool = False
    """Lightning's `deterministic`: torch's deterministic algorithms only (slower; an op without one raises)."""
    cpu_threads: Optional[int] = None
    """torch's intra-op threads in this process (`torch.set_num_threads`). null: one thread for a policy
    under `SMALL_MODEL_PARAMS` parameters (a tiny model's matmuls are too small to split, and on cores
    shared with other work two threads ran the demo 3.8x slower than one: docs/results.md), torch's
    default otherwise; `OMP_NUM_THREADS` set in the environment is then left as it is, and so is the
    count with `sampler.kind=vllm` (its CPU engine, in this process, binds torch's count as it starts).
    A run puts the count back when it ends."""
    extra: dict = field(default_factory=dict)
    """Any other `lightning.Trainer` argument, by its name, passed as given."""

    def __post_init__(self) -> None:
        self.precision = str(self.precision)  # `trainer.precision=32` arrives as an int
        require(
            self.precision in PRECISIONS,
            "trainer.precision",
            f"must be one of {', '.join(PRECISIONS)}, got {self.precision!r}",
        )
        if self.strategy == "fsdp2":
            require(
                self.precision in FSDP2_PRECISIONS,
                "trainer.precision",
                f"must be one of {', '.join(FSDP2_PRECISIONS)} with trainer.strategy=fsdp2, got {self.precision!r}",
            )
        require(
            self.accelerator in ACCELERATORS,
            "trainer.accelerator",
            f"must be one of {', '.join(ACCELERATORS)}, got {self.accelerator!r}",
        )
        require(
            self.cpu_threads is None or (isinstance(self.cpu_threads, int) and self.cpu_threads >= 1),
            "trainer.cpu_threads",
            f"must be null or a number >= 1, got {self.cpu_threads!r}",
        )
        fast = self.fast_dev_run
        require(
            isinstance(fast, bool) or (isinstance(fast, int) and fast >= 0),
            "trainer.fast_dev_run",
            f"must be true, false or a number of steps >= 0, got {fast!r}",
        )
