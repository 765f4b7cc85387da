"""Benchmark: seconds per training step by phase, against a bare-torch floor timed step by step
beside it, in the same process.

    python -m benchmarks.speed.step --repeats 3        # `make bench`, from the repository root
    python -m benchmarks.speed.step --steps 80 sampler.max_completion_tokens=...   (extra args are Hydra overrides)

The run is the arithmetic experiment without the uniform-reward filter, so every step samples
exactly P·G completions once: the floor does the same work with no framework (one batched
`generate` of the same prompts, a reference forward when the KL term is on, one
forward/backward/AdamW step over the same sequences, with the same AdamW kernel as the trainer's,
`lit_grpo.loop.optim.adamw`: fused where torch has one).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

import lightning as L
import torch

from lit_grpo.build import fit
from lit_grpo.config import TrainConfig
from lit_grpo.loop.optim import adamw
from lit_grpo.maths.logprobs import token_logprobs
from lit_grpo.models.load import load_policy, load_tokenizer
from lit_grpo.run.validate import validate
from lit_grpo.samplers.hf import HFSampler
from lit_grpo.train import compose_config

PHASES = ["perf/sample_s", "perf/ref_s", "perf/train_s", "perf/weight_sync_s", "perf/step_s"]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


class Floor:
    """The work of one training step done with bare torch + transformers: one batched `generate`
    of the same prompts, a reference forward when β > 0, one forward/backward/AdamW step over the
    same sequences. It draws from its own RNG stream, so it leaves the framework's samples as they
    would be without it."""

    def __init__(self, c: TrainConfig) -> None:
        self.c = c
        self.tokenizer = load_tokenizer(c.model)
        self.policy = load_policy(c.model, self.tokenizer, c.seed)
        self.reference = (
            load_policy(c.model, self.tokenizer, c.seed).requires_grad_(False) if c.policy_loss.kl_beta > 0 else None
        )
        self.sampler = HFSampler(self.policy, self.tokenizer)  # only its `generate`: one plain batched call
        self.optimizer = adamw(self.policy.parameters(), lr=c.learning_rate)
        P, G = c.data.prompt_groups_per_step, c.data.completions_per_prompt
        prompts = [
            self.tokenizer(f"{i % 10}+{(i // 10) % 10}=", add_special_tokens=False)["input_ids"] for i in range(P)
        ]
        self.prompts = [p for p in prompts for _ in range(G)]
        self._rng = torch.Generator().manual_seed(c.seed + 1).get_state()
        self.generate_s: list[float] = []
        self.train_s: list[float] = []

    def step(self) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.set_rng_state(self._rng)
            self._step()
            self._rng = torch.get_rng_state()

    def _step(self) -> None:
        c, pad = self.c, self.tokenizer.pad_token_id
        t0 = time.perf_counter()
        completions = self.sampler.generate(self.prompts, c.sampler.temperature, c.sampler.max_completion_tokens)
        t1 = time.perf_counter()
        width = max(len(x.full_tokens) for x in completions)
        tokens = torch.tensor([x.full_tokens + [pad] * (width - len(x.full_tokens)) for x in completions])
        attention = (
            torch.arange(width)[None] < torch.tensor([len(x.full_tokens) for x in completions])[:, None]
        ).long()
        if self.reference is not None:
            with torch.no_grad():
                token_logprobs(self.reference, tokens, attention, c.sampler.temperature)
        logprobs, _ = token_logprobs(self.policy, tokens, attention, c.sampler.temperature)
        loss = -(logprobs * attention[:, 1:]).sum() / attention[:, 1:].sum()
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        self.generate_s.append(t1 - t0)
        self.train_s.append(time.perf_counter() - t1)

    def close(self) -> None:
        self.sampler.close()


class InterleavedFloor(L.Callback):
    """One floor step inside each training step, so the two are timed a few milliseconds apart on
    the same machine state: a drift in the machine's speed (seconds long on a shared host) hits
    both alike. Callbacks' `on_train_batch_end` runs before the module's, which stamps the step's
    end, so floor step k lies inside framework step k's `perf/step_s` and is taken out of it."""

    def __init__(self, floor: Floor) -> None:
        self.floor = floor
        self.spans: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not outputs:
            return  # the stream's end: no step was trained, none is stamped
        start = time.perf_counter()
        self.floor.step()
        self.spans.append(time.perf_counter() - start)


def paired_steps(c: TrainConfig, warmup: int) -> tuple[dict[str, float], dict[str, float]]:
    """Medians over the steps after `warmup`: each phase of the real training loop, and the floor's."""
    floor = Floor(c)
    interleaved = InterleavedFloor(floor)
    try:
        _, module = fit(c, extra_callbacks=[interleaved])
    finally:
        floor.close()
    steps = module.step_sequence.history.steps
    if len(steps) != len(interleaved.spans):
        raise RuntimeError(f"{len(steps)} steps but {len(interleaved.spans)} floor steps: the pairing is off")
    ours = {phase: _median([s[phase] for s in steps[warmup:] if phase in s]) for phase in PHASES}
    ours["perf/step_s"] = _median([s["perf/step_s"] - span for s, span in zip(steps, interleaved.spans)][warmup:])
    ours["sample_tokens_per_s"] = _median([s["perf/sample_tokens_per_s"] for s in steps[warmup:]])
    ours["train_tokens_per_s"] = _median([s["perf/train_tokens_per_s"] for s in steps[warmup:]])
    gen, train = floor.generate_s[warmup:], floor.train_s[warmup:]
    theirs = {
        "generate_s": _median(gen),
        "train_s": _median(train),
        "step_s": _median([a + b for a, b in zip(gen, train)]),
    }
    return ours, theirs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument(
        "--repeats", type=int, default=1, help="fresh runs (each with its own floor); medians over the repeats"
    )
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. sampler.max_completion_tokens=4")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    runs, floors = [], []
    for _ in range(max(args.repeats, 1)):
        with tempfile.TemporaryDirectory() as out:
            cfg = compose_config(
                [
                    "+experiment=arithmetic",
                    f"max_steps={args.steps}",
                    "~callbacks.reward_filter",
                    "~callbacks.reward_curve",
                    "logger=none",
                    "output_model_id=null",
                    "trainer.enable_progress_bar=false",
                    f"output_dir={out}",
                    *args.overrides,
                ]
            )
            c = validate(cfg)
            ours, theirs = paired_steps(c, args.warmup)
            runs.append(ours)
            floors.append(theirs)
    ours = {key: _median([r[key] for r in runs]) for key in runs[0]}
    floor = {key: _median([f[key] for f in floors]) for key in floors[0]}
    ratios = [r["perf/step_s"] / f["step_s"] for r, f in zip(runs, floors)]
    B = c.data.prompt_groups_per_step * c.data.completions_per_prompt
    print(
        f"lit_grpo bench: arithmetic, B={B} sequences/step, {c.sampler.max_completion_tokens} max new tokens, "
        f"{args.steps} steps ({args.warmup} warm-up), {len(runs)} repeat(s), torch threads={torch.get_num_threads()}"
    )
    print(f"{'phase':<28}{'median s/step':>14}")
    for phase in PHASES:
        print(f"{phase:<28}{ours[phase]:>14.4f}")
    print(f"{'sample tokens/s':<28}{ours['sample_tokens_per_s']:>14.0f}")
    print(f"{'train tokens/s':<28}{ours['train_tokens_per_s']:>14.0f}")
    print(f"{'floor: generate':<28}{floor['generate_s']:>14.4f}")
    print(f"{'floor: fwd+bwd+AdamW':<28}{floor['train_s']:>14.4f}")
    print(f"{'floor: step':<28}{floor['step_s']:>14.4f}")
    if len(ratios) > 1:
        print(f"{'ratio of each repeat':<28}{'  '.join(f'{r:.2f}x' for r in ratios):>14}")
    print(f"{'ratio step / floor':<28}{_median(ratios):>14.2f}x")
    print(f"{'peak RSS':<28}{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:>11.0f} MiB")


if __name__ == "__main__":
    main()
