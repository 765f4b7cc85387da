"""Benchmark: peak memory and time of one training step at a wide vocabulary, the fused LM head on and off.

    make bench-train-memory                     # python -m benchmarks.memory.fused_head
    python -m benchmarks.memory.fused_head --tokens 1024 --repeats 5

A Qwen2 of Qwen2.5's vocabulary (151,936 ids, tied embeddings) and a tiny body (hidden 64, one
layer): the LM head is then most of the step's cost, as at real shapes with long completions.
One step is what `GRPOModule` does per micro-batch: `token_logprobs` with gradients (the prompt's
first 64 positions skipped, as `first_scored` skips a prompt), the `grpo` loss, its backward and
an AdamW step, over `--batch` × `--tokens` tokens (8 × 512 by default).

Each case (fused on or off) runs in a fresh process, the two alternating, `--repeats` times.
A case builds the model and the optimizer, warms up with a short step (kernels, the optimizer's
state), then times `--steps` full steps. Columns, medians over the repeats:
- `peak_rss_MB`: the process's peak resident memory (VmHWM) over the whole run, start-up included;
- `step_extra_MB`: that peak above the resident memory right before the timed steps (through
  /proc/self/clear_refs): what a step needs beyond the weights and the optimizer;
- `step_s`: the median time of a timed step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch

MB = 2**20
PROMPT_TOKENS = 64


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def wide_vocab_model(vocab: int, hidden: int, layers: int, seed: int = 0):
    """A random-init Qwen2 causal LM, tied embeddings, 4 heads: float32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config).eval()


def training_step(model, optimizer, tokens_BT: torch.Tensor, advantages_B: torch.Tensor, fused: bool) -> float:
    """Logprobs with gradients, the grpo loss (no KL term) on the completion tokens, backward and an
    AdamW step; returns the loss."""
    from lit_grpo.maths.logprobs import token_logprobs
    from lit_grpo.maths.losses import policy_loss

    attention_BT = torch.ones_like(tokens_BT)
    mask_BT = torch.zeros(tokens_BT.shape[0], tokens_BT.shape[1] - 1)
    mask_BT[:, PROMPT_TOKENS - 1 :] = 1  # the completion's tokens (the prompt's are not trained on)
    optimizer.zero_grad(set_to_none=True)
    logprobs_BT, _ = token_logprobs(
        model, tokens_BT, attention_BT, 1.0, first_scored=PROMPT_TOKENS - 1, fused_head=fused
    )
    loss, _ = policy_loss(
        "grpo",
        logprobs=logprobs_BT,
        old_logprobs=logprobs_BT.detach(),
        advantages=advantages_B,
        mask=mask_BT,
        kl_beta=0.0,
    )
    loss.backward()
    optimizer.step()
    return float(loss)


def measure_case(fused: bool, args: argparse.Namespace) -> dict:
    """Peak RSS and step time of one case, in this process."""
    model = wide_vocab_model(args.vocab, args.hidden, args.layers)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    g = torch.Generator().manual_seed(1)
    advantages_B = torch.randn(args.batch, generator=g)
    warm_BT = torch.randint(0, args.vocab, (args.batch, PROMPT_TOKENS + 8), generator=g)
    training_step(model, optimizer, warm_BT, advantages_B, fused)
    tokens_BT = torch.randint(0, args.vocab, (args.batch, args.tokens), generator=g)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # VmHWM back to the current VmRSS: the steps' own peak from here
    before_kb = _status_kb("VmRSS")
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        training_step(model, optimizer, tokens_BT, advantages_B, fused)
        times.append(time.perf_counter() - start)
    step_peak_kb = _status_kb("VmHWM")
    import resource

    whole_run_peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # not reset by clear_refs
    return {
        "fused": fused,
        "peak_rss_MB": max(whole_run_peak_kb, step_peak_kb) / 1024,
        "step_extra_MB": (step_peak_kb - before_kb) / 1024,
        "step_s": statistics.median(times),
    }


def _child(fused: bool, argv: list[str]) -> dict:
    cmd = [sys.executable, "-m", "benchmarks.memory.fused_head", *argv, "--case", "on" if fused else "off"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per sequence, the prompt's 64 included")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per case")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per case, alternating on/off")
    parser.add_argument("--case", default=None, help=argparse.SUPPRESS)  # a child process: on | off
    args = parser.parse_args(argv)
    if args.case is not None:
        print(json.dumps(measure_case(args.case == "on", args)))
        return
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for i in range(args.repeats):
        for fused in (True, False) if i % 2 == 0 else (False, True):
            runs[fused].append(_child(fused, argv))
    print(
        f"Qwen2, V={args.vocab:,}, hidden {args.hidden}, {args.layers} layer(s), {args.batch} x {args.tokens} tokens "
        f"(prompt {PROMPT_TOKENS}), float32, {torch.get_num_threads()} threads; medians of {args.repeats} processes"
    )
    print(f"{'fused_lm_head':<14}{'peak_rss_MB':>12}{'step_extra_MB':>15}{'step_s':>9}   per process (peak MB / s)")
    medians = {}
    for fused in (True, False):
        rows = runs[fused]
        medians[fused] = {k: statistics.median(r[k] for r in rows) for k in ("peak_rss_MB", "step_extra_MB", "step_s")}
        each = ", ".join(f"{r['peak_rss_MB']:.0f} / {r['step_s']:.2f}" for r in rows)
        m = medians[fused]
        cells = f"{m['peak_rss_MB']:>12.0f}{m['step_extra_MB']:>15.0f}{m['step_s']:>9.2f}"
        print(f"{'on' if fused else 'off':<14}{cells}   {each}")
    ratio = medians[True]["step_s"] / medians[False]["step_s"]
    memory = medians[True]["peak_rss_MB"] / medians[False]["peak_rss_MB"]
    print(f"fused / unfused: step time {ratio:.2f}x, peak RSS {memory:.2f}x")


if __name__ == "__main__":
    main()
