"""Benchmark: where a real model's training phase goes. SmolLM2-135M-Instruct's forward, backward and
AdamW step over one GRPO batch of two-digit sums (`+experiment=smollm2_sums`' shape), three ways in
alternating repeats: each group's prompt computed once (`batching.share_prefixes`, the default),
every row whole (packed), and padded; then a torch.profiler table of the default's operators.

    python -m benchmarks.speed.profile_step                        # `make bench-profile`
    python -m benchmarks.speed.profile_step --groups 2 --repeats 1  # a quick check

The batch: `--groups` prompts of chat_sums (SmolLM2's chat template, its default system prompt: 46
tokens), each with `--group-size` completions of random tokens, their lengths drawn from 4 to
`--completion-tokens`; the loss is a weighted sum of the completions' logprobs at temperature 0.7
(the policy loss's arithmetic is a few element-wise operations on top). The micro-batch is the one
`lit_grpo.loop.micro_batches.plan_forwards` makes at the defaults (`PackingCost`), whole batch,
float32, the fused LM head, no gradient checkpointing (the recipe's). Model FLOPs are
`lit_grpo.maths.flops`' (a shared prompt once), over the cached float32 GEMM peak at the thread
count (`lit_grpo.run.peak.cpu_peak`, `make bench-roofline`). Run it with nothing else running.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from lit_grpo.loop.micro_batches import MicroBatch, plan_forwards
from lit_grpo.loop.optim import adamw
from lit_grpo.maths.flops import backward_flops, forward_flops, model_shape
from lit_grpo.maths.logprobs import token_logprobs
from lit_grpo.maths.packing import packing_cost
from lit_grpo.run.peak import cpu_peak

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
KINDS = (
    ("GEMMs", ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")),
    ("attention kernels", ("scaled_dot_product",)),
    ("AdamW", ("adamw",)),
)
"""Operator kinds whose self CPU time the profile adds up (a name containing a pattern, or equal to
an `aten::` one); everything else is element-wise work, copies and dispatch."""


def kind_of(name: str) -> str:
    for kind, patterns in KINDS:
        if any(name == p if p.startswith("aten::") else p in name.lower() for p in patterns):
            return kind
    return "other (element-wise, copies, dispatch)"


def chat_batch(tokenizer, groups: int, group_size: int, max_completion: int, seed: int):
    """`groups` chat_sums prompts × `group_size` random completions, right-padded, with the first
    prediction any row trains on. Shapes: tokens, attention `[B, T]`, weights `[B, T-1]`."""
    rng = random.Random(seed)
    rows, prompt_lengths = [], []
    for _ in range(groups):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        messages = [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        for _ in range(group_size):
            completion = [rng.randrange(100, len(tokenizer)) for _ in range(rng.randint(4, max_completion))]
            rows.append(prompt + completion)
            prompt_lengths.append(len(prompt))
    T = max(map(len, rows))
    tokens_BT = torch.zeros(len(rows), T, dtype=torch.long)
    attention_BT = torch.zeros_like(tokens_BT)
    weights_BT = torch.zeros(len(rows), T - 1)
    g = torch.Generator().manual_seed(seed)
    for i, (row, p) in enumerate(zip(rows, prompt_lengths)):
        tokens_BT[i, : len(row)] = torch.tensor(row)
        attention_BT[i, : len(row)] = 1
        weights_BT[i, p - 1 : len(row) - 1] = torch.randn(len(row) - p, generator=g)
    return tokens_BT, attention_BT, weights_BT, min(prompt_lengths) - 1


def plan_micro(model, tokens_BT, attention_BT, way: str) -> MicroBatch:
    """The whole batch's micro-batch as the trainer plans it: `shared`, `whole` (packed, no sharing) or `padded`."""
    B = tokens_BT.shape[0]
    cost = packing_cost(model, "cpu", share_prefixes=way == "shared")
    plan = plan_forwards(attention_BT, [slice(0, B)], 0, 0, way != "padded", cost, tokens_BT)
    (micro,) = plan.per_minibatch[0]
    return micro


def train_step(model, optimizer, batch, micro: MicroBatch, first_scored: int) -> None:
    tokens_BT, attention_BT, weights_BT, _ = batch
    optimizer.zero_grad(set_to_none=True)
    logprobs_BT, _ = token_logprobs(
        model, tokens_BT, attention_BT, 0.7, first_scored, padding_free=micro.packed,
        prefix_groups=micro.prefix_groups,
    )  # fmt: skip
    (weights_BT * logprobs_BT).sum().backward()
    optimizer.step()


def step_flops(model, micro: MicroBatch, attention_BT, first_scored: int) -> float:
    shape, why_not = model_shape(model.config)
    assert shape is not None, why_not
    lengths = attention_BT.sum(dim=1).tolist()
    spans = micro.spans(lengths) if micro.packed else [(0, n) for n in lengths]
    head_rows = sum(n - 1 - first_scored for n in lengths)
    return float(forward_flops(shape, spans, head_rows) + backward_flops(shape, spans, head_rows))


def profile_table(model, optimizer, batch, micro, first_scored: int, rows: int) -> tuple[str, dict[str, float]]:
    """The profiler's operators by self CPU time, and each kind's share of it (`KINDS`)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_step(model, optimizer, batch, micro, first_scored)
    events = prof.key_averages()
    total = max(sum(e.self_cpu_time_total for e in events), 1)
    shares: dict[str, float] = {}
    for e in events:
        shares[kind_of(e.key)] = shares.get(kind_of(e.key), 0.0) + e.self_cpu_time_total / total
    return events.table(sort_by="self_cpu_time_total", row_limit=rows), shares


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--completion-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--profile-rows", type=int, default=14)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_grpo.models.load import resolve_model_name

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    folder = resolve_model_name(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=1e-9, betas=(0.9, 0.999), eps=1e-8)
    batch = chat_batch(tokenizer, args.groups, args.group_size, args.completion_tokens, args.seed)
    tokens_BT, attention_BT, _, first_scored = batch
    ways = ["shared", "whole", "padded"]
    micros = {way: plan_micro(model, tokens_BT, attention_BT, way) for way in ways}
    train_step(model, optimizer, batch, micros["shared"], first_scored)  # warm-up: allocator, optimizer state
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    for repeat in range(args.repeats):
        for way in ways if repeat % 2 == 0 else ways[::-1]:
            t0 = time.perf_counter()
            train_step(model, optimizer, batch, micros[way], first_scored)
            seconds[way].append(time.perf_counter() - t0)
    peak = cpu_peak(torch.float32, args.threads)
    real = int(attention_BT.sum())
    print(
        f"SmolLM2-135M-Instruct, {args.groups} prompts x {args.group_size} completions of 4..{args.completion_tokens} "
        f"tokens ({real} real tokens, prompts of {first_scored + 1}), float32, {args.threads} thread(s), "
        f"peak {peak / 1e9:.1f} GFLOP/s; forward + backward + AdamW, median of {args.repeats}\n"
    )
    print("| way | token rows computed | rows saved by sharing | s | min | max | model GFLOP | MFU |")
    print("|---|---|---|---|---|---|---|---|")
    for way in ways:
        micro, times = micros[way], seconds[way]
        rows_computed = micro.token_slots - micro.prefix_tokens_saved
        flops = step_flops(model, micro, attention_BT, first_scored)
        median = statistics.median(times)
        print(
            f"| {way} | {rows_computed} | {micro.prefix_tokens_saved} | {median:.2f} | {min(times):.2f} | "
            f"{max(times):.2f} | {flops / 1e9:.0f} | {flops / (median * peak):.2f} |"
        )
    table, shares = profile_table(model, optimizer, batch, micros["shared"], first_scored, args.profile_rows)
    print("\nshared, one step under torch.profiler, share of the self CPU time:")
    for kind, share in sorted(shares.items(), key=lambda item: -item[1]):
        print(f"  {kind}: {share:.1%}")
    print(table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
