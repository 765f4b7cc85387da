"""Benchmark: the memory of a LoRA run (the reference is the policy with its adapters off) against a
full fine-tune (the reference is a second copy of the model), both with the KL term on.

    python -m benchmarks.memory.lora                 # from the repository root
    python -m benchmarks.memory.lora --steps 5 --rank 16 model.hidden_size=768   (extra args: Hydra overrides)

Each variant trains a few steps of the arithmetic experiment on a random-init model larger than
the demo's (hidden 512, 8 layers by default, built locally) in a process of its own, and reports:
- `trainer_MB`: the tensors the trainer holds after training: the policy, the reference (unless it
  is the same weights), gradients and the optimizer state, each storage counted once;
- `peak_rss_MB`: the process's peak resident memory (`ru_maxrss`), which also counts Python, torch
  and the activations (the `hf` sampler generates with the policy itself in this synchronous run;
  before `sampler.share_policy_weights` it held a copy of the weights, counted here too).
No export (`output_model_id=null`): the numbers are those of training.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time

import torch

MODEL = ["model.hidden_size=512", "model.num_layers=8", "model.num_heads=8", "model.intermediate_size=2048"]
RUN = [
    "+experiment=arithmetic",
    "policy_loss.kl_beta=0.1",
    "callbacks=none",
    "output_model_id=null",
    "trainer.enable_progress_bar=false",
    "logger=none",
]


def _storage_bytes(tensors, seen: set[int]) -> int:
    """Bytes of the tensors' storages not counted yet (shared and tied tensors once)."""
    total = 0
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
            seen.add(t.untyped_storage().data_ptr())
            total += t.untyped_storage().nbytes()
    return total


def trainer_bytes(module, optimizer) -> dict[str, float]:
    """MB of the policy, the reference, the gradients and the optimizer state the module holds."""
    seen: set[int] = set()
    policy = _storage_bytes(module.policy.state_dict().values(), seen)
    reference = (
        _storage_bytes(module.reference.state_dict().values(), seen)
        if isinstance(module.reference, torch.nn.Module)
        else 0
    )
    grads = _storage_bytes([p.grad for p in module.policy.parameters() if p.grad is not None], seen)
    state = _storage_bytes([v for s in optimizer.state.values() for v in s.values()], seen)
    mb = 1 / 2**20
    return {
        "policy_MB": policy * mb,
        "reference_MB": reference * mb,
        "grads_MB": grads * mb,
        "optimizer_MB": state * mb,
        "trainer_MB": (policy + reference + grads + state) * mb,
    }


def run_variant(rank: int, steps: int, overrides: list[str]) -> dict[str, float]:
    """Train `steps` steps in this process (rank 0: full fine-tuning) and measure it."""
    from lit_grpo.build import fit
    from lit_grpo.run.validate import validate
    from lit_grpo.train import compose_config

    with tempfile.TemporaryDirectory() as out:
        c = validate(
            compose_config(
                [*RUN, *MODEL, f"max_steps={steps}", f"model.lora.rank={rank}", *overrides, f"output_dir={out}"]
            )
        )
        start = time.perf_counter()
        trainer, module = fit(c)
        wall = time.perf_counter() - start
    params = sum(p.numel() for p in module.policy.parameters())
    trainable = sum(p.numel() for p in module.policy.parameters() if p.requires_grad)
    return {
        "lora_rank": rank,
        "params_M": params / 1e6,
        "trainable_M": trainable / 1e6,
        **trainer_bytes(module, trainer.optimizers[0]),
        "peak_rss_MB": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "wall_s": wall,
        "steps": module.rollout_step,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank of the LoRA variant")
    parser.add_argument("--variant", type=int, default=None, help=argparse.SUPPRESS)  # a child process: this rank only
    args, overrides = parser.parse_known_args(argv)
    if args.variant is not None:
        print(json.dumps(run_variant(args.variant, args.steps, overrides)))
        return
    rows = []
    for rank in (0, args.rank):  # each in a fresh process: a peak RSS is per process
        cmd = [
            sys.executable,
            "-m",
            "benchmarks.memory.lora",
            "--variant",
            str(rank),
            "--steps",
            str(args.steps),
            *overrides,
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"variant lora_rank={rank} failed:\n{proc.stderr[-3000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    keys = list(rows[0])
    print(" | ".join(keys))
    for row in rows:
        print(" | ".join(f"{row[k]:.1f}" if isinstance(row[k], float) else str(row[k]) for k in keys))
    full, lora = rows
    print(
        f"LoRA rank {args.rank}: trainer tensors {lora['trainer_MB']:.0f} MB vs "
        f"{full['trainer_MB']:.0f} MB full fine-tuning "
        f"({lora['trainer_MB'] / full['trainer_MB']:.0%}); peak RSS {lora['peak_rss_MB']:.0f} MB vs "
        f"{full['peak_rss_MB']:.0f} MB"
    )


if __name__ == "__main__":
    main()
