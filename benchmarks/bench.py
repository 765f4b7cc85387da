"""Benchmark: seconds per training step by phase, against a bare-torch floor measured in the same process.

    python -m benchmarks.bench --repeats 3        # `make bench`, from the repository root
    python -m benchmarks.bench --steps 80 sampler.max_completion_tokens=...   (extra args are Hydra overrides)

The run is the arithmetic experiment without the uniform-reward filter, so every step samples
exactly P·G completions once: the floor does the same work with no framework (one batched
`generate` of the same prompts, a reference forward when the KL term is on, one
forward/backward/AdamW step over the same sequences, with the same AdamW kernel as the trainer's,
`lit_grpo.optim.adamw`: fused where torch has one).
"""

from __future__ import annotations

import argparse
import resource
import statistics
import tempfile
import time

import torch

from lit_grpo.config import TrainConfig, validate
from lit_grpo.models import load_policy, load_tokenizer
from lit_grpo.logprobs import token_logprobs
from lit_grpo.optim import adamw
from lit_grpo.samplers.hf import HFSampler
from lit_grpo.train import compose_config, fit

PHASES = ["perf/sample_s", "perf/ref_s", "perf/train_s", "perf/weight_sync_s", "perf/step_s"]


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def framework_steps(c: TrainConfig, warmup: int) -> dict[str, float]:
    """Median seconds of each phase over the steps after `warmup`, from the real training loop."""
    _, module = fit(c)
    steps = module.step_sequence.history.steps[warmup:]
    out = {phase: _median([s[phase] for s in steps if phase in s]) for phase in PHASES}
    out["sample_tokens_per_s"] = _median([s["perf/sample_tokens_per_s"] for s in steps])
    out["train_tokens_per_s"] = _median([s["perf/train_tokens_per_s"] for s in steps])
    return out


def floor_step(c: TrainConfig, reps: int) -> dict[str, float]:
    """Median seconds of the same work done with bare torch + transformers."""
    tokenizer = load_tokenizer(c.model)
    policy = load_policy(c.model, tokenizer, c.seed)
    reference = load_policy(c.model, tokenizer, c.seed).requires_grad_(False) if c.policy_loss.kl_beta > 0 else None
    sampler = HFSampler(policy, tokenizer)  # only its `generate`: one plain batched call
    optimizer = adamw(policy.parameters(), lr=c.learning_rate)
    P, G = c.data.prompt_groups_per_step, c.data.completions_per_prompt
    prompts = [tokenizer(f"{i % 10}+{(i // 10) % 10}=", add_special_tokens=False)["input_ids"] for i in range(P)]
    gen_s, train_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        completions = sampler.generate([p for p in prompts for _ in range(G)], c.sampler.temperature, c.sampler.max_completion_tokens)
        t1 = time.perf_counter()
        width = max(len(x.full_tokens) for x in completions)
        tokens = torch.tensor([x.full_tokens + [tokenizer.pad_token_id] * (width - len(x.full_tokens)) for x in completions])
        attention = (torch.arange(width)[None] < torch.tensor([len(x.full_tokens) for x in completions])[:, None]).long()
        if reference is not None:
            with torch.no_grad():
                token_logprobs(reference, tokens, attention, c.sampler.temperature)
        logprobs, _ = token_logprobs(policy, tokens, attention, c.sampler.temperature)
        loss = -(logprobs * attention[:, 1:]).sum() / attention[:, 1:].sum()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        t2 = time.perf_counter()
        gen_s.append(t1 - t0)
        train_s.append(t2 - t1)
    sampler.close()
    return {"generate_s": _median(gen_s), "train_s": _median(train_s), "step_s": _median([a + b for a, b in zip(gen_s, train_s)])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=1,
                        help="alternate the framework run and the floor this many times; medians over the repeats")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides, e.g. sampler.max_completion_tokens=4")
    args = parser.parse_args()
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    runs, floors = [], []
    for _ in range(max(args.repeats, 1)):  # interleaved, so a drift in the machine's speed hits both alike
        with tempfile.TemporaryDirectory() as out:
            cfg = compose_config([
                "+experiment=arithmetic", f"max_steps={args.steps}", "~callbacks.reward_filter", "~callbacks.reward_curve",
                "logger=none", "output_model_id=null", "trainer.enable_progress_bar=false", f"output_dir={out}", *args.overrides,
            ])
            c = validate(cfg)
            runs.append(framework_steps(c, args.warmup))
            floors.append(floor_step(c, reps=max(args.steps - args.warmup, 5)))
    ours = {key: _median([r[key] for r in runs]) for key in runs[0]}
    floor = {key: _median([f[key] for f in floors]) for key in floors[0]}
    ratios = [r["perf/step_s"] / f["step_s"] for r, f in zip(runs, floors)]
    B = c.data.prompt_groups_per_step * c.data.completions_per_prompt
    print(f"lit_grpo bench: arithmetic, B={B} sequences/step, {c.sampler.max_completion_tokens} max new tokens, "
          f"{args.steps} steps ({args.warmup} warm-up), {len(runs)} repeat(s), torch threads={torch.get_num_threads()}")
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
