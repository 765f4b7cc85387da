"""Benchmark: peak memory and time of one training forward + backward with gradient checkpointing off and on.

    python -m benchmarks.memory.checkpointing                   # from the repository root
    python -m benchmarks.memory.checkpointing --layers 4 --hidden 512 --batch 8 --tokens 512

A random-init Qwen2 (`model.kind=qwen2_shape`: `--hidden`, `--layers`, an MLP 4× as wide, heads of
64, float32, `--vocab` ids) takes the trainer's training forward (`token_logprobs` inside
`checkpointed_forward`, as `GRPOModule` runs it) over `--batch` × `--tokens` tokens, then the
backward of the summed logprobs. Each setting runs in a fresh process, after one warm-up step. On
CPU the peak is the process's peak resident memory (VmHWM, reset through /proc/self/clear_refs
after the warm-up) minus the resident memory before the step; on CUDA `max_memory_allocated` minus
the memory allocated before it. The weights and their gradients exist before the step (the
warm-up made them), so the peak is the step's activations and temporaries.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch

MB = 2**20


def _rss_mb(field: str) -> float:
    for line in open("/proc/self/status"):
        if line.startswith(field):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def measure(args: argparse.Namespace, checkpointing: bool) -> dict:
    from lit_grpo.config import ModelConfig
    from lit_grpo.maths.logprobs import token_logprobs
    from lit_grpo.models.checkpointing import checkpointed_forward, checkpointed_layers, enable_gradient_checkpointing
    from lit_grpo.models.load import load_policy, load_tokenizer

    cfg = ModelConfig(
        kind="qwen2_shape", vocab_size=args.vocab, hidden_size=args.hidden, num_layers=args.layers,
        num_heads=args.hidden // 64, intermediate_size=4 * args.hidden, max_position_embeddings=args.tokens,
    )  # fmt: skip
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = load_policy(cfg, load_tokenizer(cfg), seed=0).to(device).eval()
    layers = checkpointed_layers(enable_gradient_checkpointing(model)) if checkpointing else []
    tokens_BT = torch.randint(300, args.vocab, (args.batch, args.tokens), generator=torch.Generator().manual_seed(0))
    tokens_BT, attention_BT = tokens_BT.to(device), torch.ones_like(tokens_BT, device=device)

    def step() -> None:
        with checkpointed_forward(layers):
            logprobs_BT, _ = token_logprobs(model, tokens_BT, attention_BT, 1.0)
        logprobs_BT.sum().backward()

    step()  # warm-up: the gradients exist from here on, as in training
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated() / MB
    else:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current resident size
        before = _rss_mb("VmRSS:")
    start = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() / MB
    else:
        peak = _rss_mb("VmHWM:")
    return {
        "checkpointing": checkpointing,
        "step_peak_MB": round(peak - before, 1),
        "step_s": round(time.perf_counter() - start, 2),
        "device": device.type,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--one", choices=("off", "on"), help=argparse.SUPPRESS)  # a child process's setting
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args, args.one == "on")))
        return
    passed = [a for a in sys.argv[1:]]
    for setting in ("off", "on"):
        out = subprocess.run(
            [sys.executable, "-m", "benchmarks.memory.checkpointing", *passed, "--one", setting],
            capture_output=True, text=True, check=True,
        )  # fmt: skip
        print(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
