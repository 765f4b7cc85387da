"""Benchmark: the `hf` sampler's decode step on a real model against this machine's two bounds.

    python -m benchmarks.samplers.decode_bound          # `make bench-decode` (make smollm2 first)
    python -m benchmarks.samplers.decode_bound --threads 1 2 --repeats 3

A decode step reads every weight once (SmolLM2-135M-Instruct in float32: 538 MB, its tied LM head
included) and does `rows` tokens' FLOPs. So it takes at least the weights' bytes over the memory
bandwidth (the memory bound) and at least its FLOPs over the GEMM peak (the compute bound); a step
at the larger of the two runs at the machine's limit. Measured here, at each thread count:

- the bandwidth: `torch.sum` over a 512 MiB float32 tensor (read only), the median of 5;
- the peak: the cached float32 `torch.mm` peak (`make bench-roofline`, `lit_grpo.run.peak.cpu_peak`);
- the decode step: the sums recipe's shape (`+experiment=smollm2_sums`: 4 chat prompts of 46 tokens ×
  8 completions, temperature 0.7) through `HFSampler._generate`, with at most 1 and at most 16 new
  tokens in alternating repeats; a step's time is the difference over the extra decode steps the
  longer call made (its longest completion less one): the prefill and the first step cancel out.
  With the sampler's linear layers through oneDNN (`lit_grpo.maths.onednn_linear`, the sampler's
  default from 2 torch threads) and through torch's default (MKL, its default at 1 thread).

Its FLOPs are `lit_grpo.maths.flops`' (a decode step of each row at the mean context length). Run it
with nothing else running.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from lit_grpo.maths.flops import forward_flops, model_shape
from lit_grpo.run.peak import cpu_peak, torch_threads

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def read_bandwidth(repeats: int = 5, mib: int = 512) -> float:
    """Bytes per second `torch.sum` reads from a `mib` MiB float32 tensor (the median of `repeats`)."""
    values = torch.ones(mib * 2**20 // 4)
    values.sum()  # the pages touched once before timing
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        values.sum()
        seconds.append(time.perf_counter() - t0)
    return values.numel() * 4 / statistics.median(seconds)


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the model's distinct weight storages (a tied head counted once)."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    return sum(storages.values())


def chat_prompts(tokenizer, groups: int, group_size: int) -> list[list[int]]:
    """`groups` chat_sums prompts, each `group_size` times (a group's rows side by side)."""
    prompts = []
    for a, b in [(12, 34), (56, 78), (91, 23), (45, 67), (38, 29), (74, 16), (83, 55), (27, 62)][:groups]:
        messages = [{"role": "user", "content": f"What is {a} + {b}? Answer with the number only."}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts += [tokenizer(text, add_special_tokens=False)["input_ids"]] * group_size
    return prompts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_grpo.models.load import resolve_model_name
    from lit_grpo.samplers.hf import HFSampler

    folder = resolve_model_name(MODEL)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa").eval()
    sampler = HFSampler(model, tokenizer, share_weights=True)
    prompts = chat_prompts(tokenizer, args.groups, args.group_size)
    rows, prompt_len = len(prompts), len(prompts[0])
    shape, why_not = model_shape(model.config)
    assert shape is not None, why_not
    step_bytes = weight_bytes(model)
    context = prompt_len + args.max_tokens // 2
    step_flops = forward_flops(shape, [(context, context + 1)] * rows, rows)
    print(
        f"SmolLM2-135M-Instruct, float32, {rows} rows a decode step ({args.groups} prompts of {prompt_len} tokens "
        f"× {args.group_size}), at most {args.max_tokens} new tokens, temperature 0.7; weights {step_bytes / 1e6:.0f} "
        f"MB, {step_flops / 1e9:.2f} GFLOP a decode step; median of {args.repeats}\n"
    )
    print(
        "| threads | linear layers | decode step ms | tokens/s | memory bound ms (GB/s) | compute bound ms "
        "(GFLOP/s) | bound / step |"
    )
    print("|---|---|---|---|---|---|---|")
    for threads in args.threads:
        with torch_threads(threads):
            bandwidth = read_bandwidth()
            peak = cpu_peak(torch.float32, threads)
            memory_s, compute_s = step_bytes / bandwidth, step_flops / peak
            for onednn in (True, False):
                sampler.onednn_linear = onednn
                sampler._generate(prompts, 0.7, 2)  # warm-up
                steps_ms = []
                for repeat in range(args.repeats):
                    timed = {}
                    for max_tokens in (1, args.max_tokens) if repeat % 2 == 0 else (args.max_tokens, 1):
                        torch.manual_seed(repeat)
                        t0 = time.perf_counter()
                        out = sampler._generate(prompts, 0.7, max_tokens)
                        longest = max(len(c.full_tokens) - c.prompt_len for c in out)
                        timed[max_tokens] = (time.perf_counter() - t0, longest)
                    (short_s, _), (long_s, steps) = timed[1], timed[args.max_tokens]
                    if steps > 1:
                        steps_ms.append((long_s - short_s) / (steps - 1) * 1e3)
                step_ms = statistics.median(steps_ms)
                bound_ms = max(memory_s, compute_s) * 1e3
                print(
                    f"| {threads} | {'oneDNN' if onednn else 'MKL'} | {step_ms:.0f} | {rows / step_ms * 1e3:.0f} | "
                    f"{memory_s * 1e3:.0f} ({bandwidth / 1e9:.1f}) | {compute_s * 1e3:.0f} ({peak / 1e9:.1f}) | "
                    f"{bound_ms / step_ms:.2f} |",
                    flush=True,
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
