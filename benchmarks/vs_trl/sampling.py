"""Benchmark: the sampling phase alone, at the rehearsal's shape: lit_grpo's `hf` sampler (one generate
call with its per-token scoring) against the bare `generate` call TRL's `GRPOTrainer` makes (no
scoring), interleaved in one process on one model, so the machine's load reaches all of them alike.

    python -m benchmarks.vs_trl.sampling                         # 2 layers, 2 x 8 rows, 32 tokens, 5 repeats
    python -m benchmarks.vs_trl.sampling --tokens 128 --repeats 3
    python -m benchmarks.vs_trl.sampling --experiment smollm2_sums --prompts 8 --group 8 --tokens 64 \
        --temperature 0.7
    python -m benchmarks.vs_trl.sampling --layers 1 --prompts 1 --tokens 256 --override model.hidden_size=64 \
        --override model.intermediate_size=256 --override model.num_heads=4 --override model.num_kv_heads=4

The model is `benchmarks/vs_trl/rehearsal.py`'s (the random-init Qwen2.5-0.5B shapes cut to `--layers`,
151,936 ids, float32, lit_grpo's builder and seed); the prompts are the first `--prompts` GSM8K rows
through the chat template, each `--group` times (a step's one generate call: 16 rows by default),
left-padded. Three variants, their order rotated every repeat:

- `lit`: `HFSampler._generate` on the policy itself (`share_weights`, as the rehearsal's synchronous
  run), temperature 1, top-p 1, top-k 0: generate with the logprob recorder scoring each token
  (`chosen_logprobs`) and each token drawn by `draw_tokens`, then the cut at eos and the decoding.
- `lit_main`: the same sampler without two of its sampling-speed changes (it keeps its draw): the recorder's
  former per-step formula, `log_softmax(logits).gather(token)` over the whole vocabulary, and the
  LM head handed the prefill's strided last-position slice (`_contiguous_head_input` off), which
  ATen runs as a bmm over the rows when no weight requires grad.
- `generate`: `model.generate` with the `GenerationConfig` TRL 1.16 builds when it samples with
  transformers (`trl/trainer/grpo_trainer.py`: do_sample, temperature 1, top-p 1, top-k 0, the
  tokenizer's pad, bos and eos, `disable_compile`), under `torch.no_grad` with the policy's
  parameters requiring grad, as in TRL's training; no processor of its own, no decoding.

Each call is seeded alike; a random-init model rarely draws eos, so every row runs to `--tokens`
(the table's `mean len` says). Reported: each variant's median seconds a call, min and max, its
median CPU seconds (this process's, all threads: less moved than the wall time by other work on the
machine), and the median over repeats of `lit` / `generate` taken within a repeat (the paired ratio).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time

import torch

import lit_grpo.samplers.hf as hf
from benchmarks.vs_trl.rehearsal import Settings


def naive_chosen_logprobs(logits_NV: torch.Tensor, tokens_N: torch.Tensor, temperature: float):
    """The recorder's former scoring: a whole `[N, V]` log_softmax per logprob (raw, and tempered)."""
    logits_NV, tokens_N1 = logits_NV.float(), tokens_N[:, None]
    raw_N = torch.log_softmax(logits_NV, dim=-1).gather(-1, tokens_N1)[:, 0]
    if temperature == 1.0:
        return raw_N, raw_N
    return torch.log_softmax(logits_NV / temperature, dim=-1).gather(-1, tokens_N1)[:, 0], raw_N


def experiment_overrides(experiment: str, settings: Settings) -> list[str]:
    """A recipe of a real model (`+experiment=smollm2_sums`) at the benchmark's shape."""
    return [
        f"+experiment={experiment}",
        f"data.prompt_groups_per_step={settings.prompts}",
        f"data.completions_per_prompt={settings.group}",
        f"sampler.max_completion_tokens={settings.tokens}",
        *settings.lit_overrides,
    ]


def build(settings: Settings, experiment: str | None = None):
    """The policy and tokenizer of the rehearsal (or of `experiment`, a recipe's real model), and a
    step's prompts (token ids, each `group` times)."""
    import dataclasses
    import tempfile

    from lit_grpo.models.load import load_policy, load_tokenizer, with_resolved_model
    from lit_grpo.run.validate import validate
    from lit_grpo.samplers.arguments import chat_prompt_tokens
    from lit_grpo.tasks import training_rows
    from lit_grpo.train import compose_config

    overrides = experiment_overrides(experiment, settings) if experiment else settings.lit_config_overrides()
    c = validate(compose_config([*overrides, f"output_dir={tempfile.mkdtemp()}"]))
    c = dataclasses.replace(c, model=with_resolved_model(c.model))
    tokenizer = load_tokenizer(c.model)
    policy = load_policy(c.model, tokenizer, c.seed).eval()
    rows = training_rows(c)[: settings.prompts]
    prompts = [chat_prompt_tokens(tokenizer, row["messages"]) for row in rows for _ in range(settings.group)]
    return policy, tokenizer, prompts


def trl_like_generate(
    policy, tokenizer, prompts: list[list[int]], max_tokens: int, temperature: float = 1.0
) -> list[int]:
    """The generate call of TRL's transformers path on left-padded prompts; each row's new-token count
    (up to and with its eos, as TRL's completion mask counts)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        max_new_tokens=max_tokens,
        do_sample=True,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=[tokenizer.eos_token_id],
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        min_p=None,
        repetition_penalty=1.0,
        cache_implementation=None,
        disable_compile=True,
    )
    width = max(map(len, prompts))
    input_ids = torch.full((len(prompts), width), tokenizer.pad_token_id, dtype=torch.long)
    attention = torch.zeros_like(input_ids)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :], attention[i, width - len(p) :] = torch.tensor(p), 1
    with torch.no_grad():
        out = policy.generate(input_ids=input_ids, attention_mask=attention, generation_config=config)
    new_NS = out[:, width:]
    is_eos_NS = new_NS == tokenizer.eos_token_id
    first_eos_N = torch.where(is_eos_NS.any(dim=1), is_eos_NS.int().argmax(dim=1) + 1, new_NS.shape[1])
    return [int(n) for n in first_eos_N]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for name, default in (("layers", 2), ("tokens", 32), ("prompts", 2), ("group", 8), ("repeats", 5), ("seed", 0)):
        parser.add_argument(f"--{name}", type=int, default=default)
    parser.add_argument(
        "--override", action="append", default=[], metavar="KEY=VALUE",
        help="a Hydra override of the rehearsal run, e.g. model.hidden_size=64 (the model's shape)",
    )  # fmt: skip
    parser.add_argument(
        "--experiment", default=None, metavar="NAME",
        help="a real model's recipe, not the rehearsal's random-init model: smollm2_sums (make smollm2 first)",
    )  # fmt: skip
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args()
    settings = Settings(
        layers=args.layers, tokens=args.tokens, prompts=args.prompts, group=args.group, lit_overrides=args.override
    )
    policy, tokenizer, prompts = build(settings, args.experiment)
    sampler = hf.HFSampler(policy, tokenizer, share_weights=True)
    scoring, contiguous = hf.chosen_logprobs, hf._contiguous_head_input

    def lit() -> list[int]:
        completions = sampler._generate(prompts, args.temperature, args.tokens)
        return [len(c.full_tokens) - c.prompt_len for c in completions]

    def lit_main() -> list[int]:
        hf.chosen_logprobs = naive_chosen_logprobs  # the recorder looks both up at each call
        hf._contiguous_head_input = lambda model: contextlib.nullcontext()
        try:
            return lit()
        finally:
            hf.chosen_logprobs, hf._contiguous_head_input = scoring, contiguous

    variants = {
        "lit": lit,
        "lit_main": lit_main,
        "generate": lambda: trl_like_generate(policy, tokenizer, prompts, args.tokens, args.temperature),
    }
    names = list(variants)
    seconds: dict[str, list[float]] = {n: [] for n in names}
    cpu_seconds: dict[str, list[float]] = {n: [] for n in names}
    lengths: dict[str, list[int]] = {n: [] for n in names}
    for name in ("generate", "lit"):  # warm-up: the allocator's and the first call's costs
        variants[name]()
    for repeat in range(args.repeats):
        for name in names[repeat % 3 :] + names[: repeat % 3]:
            torch.manual_seed(args.seed + repeat)
            start, cpu_start = time.perf_counter(), time.process_time()
            lengths[name] += variants[name]()
            seconds[name].append(time.perf_counter() - start)
            cpu_seconds[name].append(time.process_time() - cpu_start)
        print(
            f"repeat {repeat + 1}: "
            + ", ".join(f"{n} {seconds[n][-1]:.2f} s (CPU {cpu_seconds[n][-1]:.2f} s)" for n in names),
            flush=True,
        )

    model = f"+experiment={args.experiment}" if args.experiment else f"rehearsal shapes, {args.layers} layers"
    print(
        f"sampling: {model}, {len(prompts)} rows x {args.tokens} tokens, T {args.temperature:g}, "
        f"{args.repeats} repeats, {torch.get_num_threads()} torch threads"
    )
    header = f"{'variant':<17} {'median s':>9} {'min s':>7} {'max s':>7} {'CPU s median':>13} {'mean len':>9}"
    print(header + f" {'tokens/s':>9}")
    for n in names:
        s, mean_len = seconds[n], statistics.fmean(lengths[n])
        cpu, per_call = statistics.median(cpu_seconds[n]), statistics.median(s)
        rate = sum(lengths[n]) / sum(s)  # generated tokens (to eos) over the calls' wall time
        print(f"{n:<17} {per_call:>9.2f} {min(s):>7.2f} {max(s):>7.2f} {cpu:>13.2f} {mean_len:>9.1f} {rate:>9.1f}")
    for n in ("lit", "lit_main"):
        for label, clock in (("wall", seconds), ("CPU", cpu_seconds)):
            ratios = [a / b for a, b in zip(clock[n], clock["generate"])]
            print(
                f"{n} / generate, paired, {label} time: median {statistics.median(ratios):.3f} "
                f"(min {min(ratios):.3f}, max {max(ratios):.3f})"
            )


if __name__ == "__main__":
    main()
