"""Benchmark: the CPU rehearsal (`+experiment=rehearsal_0p5b`) in lit_grpo and in TRL's `GRPOTrainer`,
side by side: seconds per step and peak resident memory. Three sides by default: lit_grpo with
`--micro-batch` sequences per forward (`lit`), lit_grpo with `--token-budget` tokens per forward
(`lit_budget`: `batching.micro_batch_max_tokens`), and TRL with `--micro-batch` (`trl`).

    make bench-rehearsal                                  # installs the pinned trl here first
    python -m benchmarks.vs_trl.rehearsal                        # the experiment's settings: 4 layers, 2×8, 256 tokens
    python -m benchmarks.vs_trl.rehearsal --layers 2 --steps 2 --tokens 64          # a quick check
    python -m benchmarks.vs_trl.rehearsal --sides lit --lit-override batching.micro_batch_size=8  # lit_grpo only
    python -m benchmarks.vs_trl.rehearsal --trl-arg use_transformers_paged=true
    python -m benchmarks.vs_trl.rehearsal --ragged --sides lit_budget,trl --trl-arg gradient_checkpointing=true

Both sides train the same model: the random-init Qwen2.5-0.5B-shaped `model=rehearsal_0p5b` cut to
`--layers` decoder layers, built by lit_grpo's builder from the same seed (TRL's side writes it to a
temporary folder and hands TRL the path, as TRL builds its reference model from a path); on the same
GSM8K rows (the 256 shipped in the package, in file order, unshuffled on both sides) with the `gsm8k`
reward; with the same G, prompts per step, completion length, learning rate, β (k3 KL to a frozen
reference), clip ε = 0.2, token-mean loss over the whole step (TRL's `loss_type="dapo"`), AdamW
(weight decay 0.01, gradient clip 1.0), a constant learning rate, sequences per forward/backward
(`--micro-batch`: lit_grpo's `batching.micro_batch_size`, TRL's `per_device_train_batch_size`, with
gradient accumulation over the step), one optimizer step per batch of rollouts, float32. Gradient
checkpointing: lit_grpo's default (`model.gradient_checkpointing` null: on from `hidden_size ×
num_layers` 16,384, so off for every cut below 19 layers), TRL's off unless `--trl-arg
gradient_checkpointing=true` (GRPOConfig's own default is on). The `lit_budget` side at the default
`--token-budget` 2048 is the experiment's own batching, i.e. lit_grpo's defaults (fused LM head,
padding-free packing, 2,048-token micro-batches). Each side runs in a process of its own, one
after the other, so their peaks do not mix: a step's time is the wall time between the ends of
consecutive optimizer steps (the first from the start of training), the median taken over the steps
after the first (`--warmup`); peak RSS is the process's `ru_maxrss` (model building and loading
included). lit_grpo's side runs without checkpoints or the final export, as TRL's runs without
saving. `sample s` is the sampling phase's median seconds a step: lit_grpo's `perf/sample_s`
(generate with its per-token scoring, the decoding, the reward), TRL's time in its
`_generate_single_turn` (generate and the eos mask; its reward comes after), so lit_grpo's figure
holds a little more work than TRL's.

Ragged completions (`--ragged`). A random-init model rarely samples eos, so without it every
completion runs to `--tokens` and no padding or packing difference shows. With it, both sides end
the k-th completion they generate at the k-th length of one stream (`ragged_lengths`: uniform
integers in 0.25-1× `--tokens`, drawn one at a time from `random.Random(--seed)`), whatever rows a
side puts in one generate call. Each side's process wraps transformers' `GenerationMixin.generate`
(`install_ragged_lengths`; both sides sample through it) to append one logits processor
(`RaggedLengths`) that leaves every id but eos at -inf at a row's last step: a real eos, which
each side then handles as its own (lit_grpo cuts the completion there, TRL masks after it). The
processor runs after lit_grpo's logprob recorder and never writes the scores in place, so the
recorder scores the forced eos under the model's own logits, as the trainer does. The rows of a
call still decode until the call's longest one ends, on both sides; `mean len` in the table shows
both sides trained on the same lengths.

What differs and could not be made equal (each is either side's own design):

- Sampling. Both generate with the policy itself through transformers' `generate` (temperature 1,
  top-p 1, top-k 0, left-padded prompts): lit_grpo's `sampler=hf` shares the policy's weights in
  synchronous training (`sampler.share_policy_weights=auto`), so its weight sync copies nothing.
  lit_grpo scores each sampled token as it is drawn (the sampler's logprobs, for the importance
  weights); TRL keeps none.
- Importance weights. lit_grpo's `grpo` loss multiplies each token by the truncated weight
  min(exp(old - sampler), 5) (about 1 here); TRL's uses no sampler logprobs without vLLM.
- Logits. lit_grpo runs the LM head from the first completion column of each micro-batch
  (transformers' `logits_to_keep`) over right-padded prompt + completion rows, then its chunked
  log-softmax; TRL left-pads prompts, keeps the completion's logits only, and runs its chunked
  log-prob kernel (`fused_lm_head=True`, `trl/kernels/chunked_logprob.py`).
- Reference model. lit_grpo's is a deep copy of the built policy; TRL loads its own from the
  folder (the same weights).
- Optimizer. Both run torch's fused AdamW (TRL: `TrainingArguments`' `adamw_torch_fused`), but
  transformers' Trainer exempts biases and norm weights from weight decay, lit_grpo decays every
  parameter. Gradient clipping, the learning-rate schedule and the loss's normalization are the
  same maths, written separately.
- Bookkeeping. lit_grpo logs its health metrics (drift, entropy, TIS weights) every step and runs its
  rollouts through an event loop (with synchronous training the engine runs on the trainer's own
  thread); TRL logs its own metrics.
- Versions. Both sides run in the environment the benchmark runs in (the same torch and
  transformers), which is not lit_grpo's own when trl moved a dependency on install.

The prompts are the same token ids on both sides (one tokenizer, one chat template, no special tokens added).

Rewards of a random-init model are all 0, so every advantage is 0 on both sides: the compute per
step is the same as with learning, only the update is nearly zero (the KL term and weight decay).
The numbers depend on the machine: run it with nothing else running.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Optional

import torch

RUN_TIMEOUT_S = 4 * 3600


@dataclasses.dataclass
class Settings:
    """What both sides run; `lit_overrides` and `trl_args` reach one side only."""

    layers: int = 4
    """Decoder layers of the Qwen2.5-0.5B-shaped model (it has 24)."""
    steps: int = 4
    """Optimizer steps (one per batch of rollouts)."""
    warmup: int = 1
    """Steps left out of the median."""
    prompts: int = 2
    """P: prompts per step."""
    group: int = 8
    """G: completions per prompt."""
    tokens: int = 256
    """Completion length (max new tokens; a random-init model rarely stops earlier)."""
    micro_batch: int = 4
    """Sequences per forward/backward."""
    learning_rate: float = 1e-6
    kl_beta: float = 0.001
    dtype: str = "float32"
    seed: int = 0
    ragged: bool = False
    """End each completion at a length drawn uniformly in 0.25-1x `tokens` (`RaggedLengths`), the same
    draws on both sides; off, a random-init model's completions all run to `tokens`."""
    token_budget: int = 2048
    """lit_grpo's `lit_budget` side: `batching.micro_batch_max_tokens` (no count of sequences), not `micro_batch`."""
    lit_overrides: list = dataclasses.field(default_factory=list)
    """Hydra overrides for lit_grpo's side, e.g. batching.micro_batch_max_tokens=4096; TRL's side trains
    the model lit_grpo's config builds, so `model.*` ones (its shape) reach it too."""
    trl_args: dict = dataclasses.field(default_factory=dict)
    """GRPOConfig fields for TRL's side, e.g. {"use_transformers_paged": True}."""

    def lit_config_overrides(self, side: str = "lit") -> list[str]:
        """The lit_grpo run: the experiment at these settings, no checkpoints, no export; micro-batches
        of `micro_batch` sequences (`lit`) or of at most `token_budget` tokens (`lit_budget`)."""
        micro = (
            ["batching.micro_batch_size=0", f"batching.micro_batch_max_tokens={self.token_budget}"]
            if side == "lit_budget"
            else [f"batching.micro_batch_size={self.micro_batch}", "batching.micro_batch_max_tokens=0"]
        )
        return [
            "+experiment=rehearsal_0p5b",
            f"model.num_layers={self.layers}",
            f"model.dtype={self.dtype}",
            f"max_steps={self.steps}",
            f"data.prompt_groups_per_step={self.prompts}",
            f"data.completions_per_prompt={self.group}",
            f"sampler.max_completion_tokens={self.tokens}",
            f"data.max_seq_len={self.tokens + 512}",  # every GSM8K prompt fits
            *micro,
            f"learning_rate={self.learning_rate}",
            f"policy_loss.kl_beta={self.kl_beta}",
            f"seed={self.seed}",
            "data.shuffle=false",  # the rows in file order, as TRL's side takes them
            "checkpoint.save_interval=0",
            "resume=null",
            "output_model_id=null",
            "callbacks=none",
            "logger=csv",
            "trainer.enable_progress_bar=false",
            *self.lit_overrides,
        ]


def peak_rss_gib() -> float:
    """This process's peak resident memory (Linux reports kB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


RAGGED_MIN_FRACTION = 0.25


def ragged_lengths(seed: int, max_tokens: int) -> Iterator[int]:
    """The completion lengths of `--ragged`, one per generated row in the order rows are generated:
    uniform integers in [ceil(0.25 · max_tokens), max_tokens] from a generator seeded with `seed`,
    drawn one at a time, so the stream does not depend on how a side groups its rows into calls."""
    draw = random.Random(seed)
    low = max(1, math.ceil(RAGGED_MIN_FRACTION * max_tokens))
    while True:
        yield draw.randint(low, max_tokens)


class RaggedLengths:
    """A logits processor that makes row i of a `generate` call draw eos as its `lengths[i]`-th token
    (the eos included): every other id gets -inf at that step, nothing changes before it. A new
    tensor is returned, never the input written in place: a processor earlier in the list (lit_grpo's
    logprob recorder) keeps a reference to the raw scores, and still scores the forced eos there."""

    def __init__(self, lengths: list[int], eos_id: int) -> None:
        self.lengths, self.eos_id = lengths, eos_id
        self.prompt_width: Optional[int] = None

    def __call__(self, input_ids_NS: torch.Tensor, scores_NV: torch.Tensor) -> torch.Tensor:
        if self.prompt_width is None:  # the first step: input_ids are the (left-padded) prompts
            self.prompt_width = input_ids_NS.shape[1]
        generated = input_ids_NS.shape[1] - self.prompt_width
        ends_N = torch.tensor([n - 1 == generated for n in self.lengths], device=scores_NV.device)
        if not bool(ends_N.any()):
            return scores_NV
        eos_only_V = torch.full_like(scores_NV[0], float("-inf"))
        eos_only_V[self.eos_id] = 0.0
        return torch.where(ends_N[:, None], eos_only_V, scores_NV)


def install_ragged_lengths(settings: Settings) -> None:
    """`--ragged`, in the process of either side: wrap transformers' `generate` (both sides sample
    through it, on the policy itself) so that each call appends a `RaggedLengths` processor over the
    next rows of the seeded length stream, after any processor of the caller's own."""
    from transformers import LogitsProcessorList
    from transformers.generation.utils import GenerationMixin

    stream = ragged_lengths(settings.seed, settings.tokens)
    plain_generate = GenerationMixin.generate

    def generate(model, *args, **kwargs):
        rows = (kwargs.get("input_ids") if kwargs.get("input_ids") is not None else args[0]).shape[0]
        eos = kwargs["generation_config"].eos_token_id  # both sides pass their config
        forced = RaggedLengths([next(stream) for _ in range(rows)], eos[0] if isinstance(eos, list) else eos)
        kwargs["logits_processor"] = LogitsProcessorList([*(kwargs.get("logits_processor") or []), forced])
        return plain_generate(model, *args, **kwargs)

    GenerationMixin.generate = generate  # type: ignore[method-assign]


def step_summary(step_seconds: list[float], warmup: int) -> dict:
    measured = step_seconds[warmup:] or step_seconds
    return {
        "steps": len(step_seconds),
        "step_s_median": statistics.median(measured) if measured else float("nan"),
        "first_step_s": step_seconds[0] if step_seconds else float("nan"),
        "step_s": step_seconds,
    }


def phase_summary(sample_seconds: list[float], completion_lengths: list[float], warmup: int) -> dict:
    """The sampling phase's median seconds a step over the steps after `warmup`, each step's, and the
    mean completion length over all steps (the same on both sides with `--ragged`)."""
    measured = sample_seconds[warmup:] or sample_seconds
    return {
        "sample_s_median": statistics.median(measured) if measured else float("nan"),
        "sample_s": sample_seconds,
        "completion_len_mean": statistics.fmean(completion_lengths) if completion_lengths else float("nan"),
    }


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in ("torch", "transformers", "lightning", "trl", "lit_grpo"):
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "-"
    return found


def train_lit(overrides: list[str], work_dir: Path) -> Callable[[str], list[float]]:
    """Train lit_grpo in this process with these Hydra overrides, into `work_dir`; a reader of its
    metrics.csv columns (one value per row that logged the metric)."""
    import csv

    from lit_grpo.train import compose_config, train

    train(compose_config([*overrides, f"output_dir={work_dir}"]))
    rows = list(csv.DictReader((work_dir / "metrics.csv").open()))

    def column(name: str) -> list[float]:
        return [float(r[name]) for r in rows if r.get(name)]

    return column


def run_lit_side(settings: Settings, work_dir: Path, side: str = "lit") -> dict:
    """lit_grpo's side, in this process: the experiment through `train`; its steps from metrics.csv.
    `lit_budget` cuts micro-batches by tokens (`batching.micro_batch_max_tokens`) instead of by sequences."""
    if settings.ragged:
        install_ragged_lengths(settings)
    start = time.perf_counter()
    column = train_lit(settings.lit_config_overrides(side), work_dir)
    padding = column("perf/padding_frac")
    return {
        "side": "lit_grpo" if side == "lit" else f"lit_grpo, {settings.token_budget}-token micro-batches",
        **step_summary(column("perf/step_s"), settings.warmup),
        **phase_summary(column("perf/sample_s"), column("rollout/completion_len_mean"), settings.warmup),
        "padding_frac": statistics.median(padding) if padding else float("nan"),
        "wall_s": time.perf_counter() - start,
    }


def run_side_in_subprocess(side: str, settings: Settings, work_dir: Path) -> dict:
    """One side in a fresh interpreter (its own peak memory); its result, or an exit with its log's tail."""
    out, log = work_dir / f"{side}.json", work_dir / f"{side}.log"
    module = "benchmarks.vs_trl.rehearsal_trl" if side == "trl" else "benchmarks.vs_trl.rehearsal"
    command = [sys.executable, "-m", module, "--run-side", side, "--settings", json.dumps(dataclasses.asdict(settings))]
    command += ["--out", str(out), "--work-dir", str(work_dir / side)]
    return run_logged(side, command, out, log)


def run_logged(label: str, command: list[str], out: Path, log: Path, timeout_s: float = RUN_TIMEOUT_S) -> dict:
    """Run `command` with its output in `log`; the JSON it wrote to `out`, or an exit with the log's tail."""
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, timeout=timeout_s)
    if done.returncode != 0:
        sys.exit(
            f"{label}: the run failed (exit {done.returncode}); the end of its log ({log}):\n{log.read_text()[-4000:]}"
        )
    return json.loads(out.read_text())


def table(results: list[dict], settings: Settings) -> str:
    s = settings
    lines = [
        f"rehearsal: Qwen2.5-0.5B shapes cut to {s.layers} layers, {s.dtype}, {s.prompts} prompts x G={s.group}, "
        f"{s.tokens} completion tokens{' (ragged: 0.25-1x)' if s.ragged else ''}, micro-batch {s.micro_batch}, "
        f"lr {s.learning_rate:g}, beta {s.kl_beta:g}, "
        f"{s.steps} steps (median over steps after the first {s.warmup})",
        f"{'side':<40} {'s/step':>9} {'sample s':>9} {'first step s':>13} {'peak RSS GiB':>13} {'padding':>8} "
        f"{'mean len':>9} {'steps':>6}",
    ]
    for r in results:
        padding = f"{r['padding_frac']:>8.2f}" if "padding_frac" in r else f"{'-':>8}"
        lines.append(
            f"{r['side']:<40} {r['step_s_median']:>9.1f} {r.get('sample_s_median', float('nan')):>9.2f} "
            f"{r['first_step_s']:>13.1f} {r['peak_rss_gib']:>13.2f} {padding} "
            f"{r.get('completion_len_mean', float('nan')):>9.1f} {r['steps']:>6}"
        )
    lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in results[0]["versions"].items()) if results else "")
    return "\n".join(lines)


def parse_value(text: str):
    """A --trl-arg value: JSON where it parses (true, 3, 0.5), else the string."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def main() -> None:
    defaults = Settings()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for field in ("layers", "steps", "warmup", "prompts", "group", "tokens", "micro_batch", "token_budget"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=getattr(defaults, field))
    parser.add_argument("--learning-rate", type=float, default=defaults.learning_rate)
    parser.add_argument("--kl-beta", type=float, default=defaults.kl_beta)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default=defaults.dtype)
    parser.add_argument(
        "--ragged", action="store_true", help="end completions at seeded lengths in 0.25-1x --tokens, both sides"
    )
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--sides", default="lit,lit_budget,trl", help="comma-separated: lit, lit_budget, trl")
    parser.add_argument(
        "--lit-override", action="append", default=[], metavar="KEY=VALUE",
        help="a Hydra override of lit_grpo's run; TRL's side trains the model it builds, so model.* ones reach it too",
    )  # fmt: skip
    parser.add_argument(
        "--trl-arg", action="append", default=[], metavar="KEY=VALUE", help="GRPOConfig field, TRL only"
    )
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (logs, metrics)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    # One side in this process (what the driver runs in a subprocess).
    parser.add_argument("--run-side", choices=["lit", "lit_budget"], help=argparse.SUPPRESS)
    parser.add_argument("--settings", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.run_side:
        settings = Settings(**json.loads(args.settings))
        result = run_lit_side(settings, args.work_dir, args.run_side)
        args.out.write_text(json.dumps({**result, "peak_rss_gib": peak_rss_gib(), "versions": versions()}))
        return

    settings = Settings(
        **{
            f: getattr(args, f)
            for f in ("layers", "steps", "warmup", "prompts", "group", "tokens", "micro_batch", "token_budget")
        },
        learning_rate=args.learning_rate,
        kl_beta=args.kl_beta,
        dtype=args.dtype,
        seed=args.seed,
        ragged=args.ragged,
        lit_overrides=list(args.lit_override),
        trl_args={k: parse_value(v) for k, _, v in (a.partition("=") for a in args.trl_arg)},
    )
    root = Path(tempfile.mkdtemp(prefix="rehearsal-bench-"))
    results = []
    for side in [s.strip() for s in args.sides.split(",") if s.strip()]:
        if side not in ("lit", "lit_budget", "trl"):
            sys.exit(f"--sides: unknown side {side!r}; valid: lit, lit_budget, trl")
        print(f"running {side} ... (log: {root / (side + '.log')})", flush=True)
        results.append(run_side_in_subprocess(side, settings, root))
    print(table(results, settings))
    if args.json:
        args.json.write_text(json.dumps({"settings": dataclasses.asdict(settings), "results": results}, indent=1))
    if args.keep:
        print(f"runs kept in {root}")
    else:
        import shutil

        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
