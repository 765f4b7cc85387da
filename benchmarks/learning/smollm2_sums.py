"""Benchmark: SmolLM2-135M-Instruct learns two-digit sums on this CPU (`+experiment=smollm2_sums`).

    python -m benchmarks.learning.smollm2_sums     # `make bench-smollm2-sums`: seeds 0 1 2, one after another
    python -m benchmarks.learning.smollm2_sums --seeds 0 --override max_steps=4

Each seed is `python -m lit_grpo.train +experiment=smollm2_sums seed=S` in a process of its own,
run alone (their wall times are the recipe's). Its exported `final_model/` is then loaded again
with transformers alone (`AutoModelForCausalLM`, greedy `generate`, the task's held-out rows through
the model's chat template, the `last_integer` reward) and scored: the accuracy the run reported
must be the accuracy its export gives. The base model is scored the same way once. Each accuracy
comes with its Wilson 95 % interval over the held-out rows; the table is printed as Markdown and
written to `--out` with every run's reward curve.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXPERIMENT = "smollm2_sums"


def wilson_interval(successes: int, n: int, z: float = 1.959964) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion (95 % by default)."""
    if n == 0:
        return (float("nan"), float("nan"))
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return (centre - half, centre + half)


def heldout_accuracy(folder: str, count: int, max_new_tokens: int, batch_size: int = 50) -> tuple[int, int]:
    """(correct, scored) of greedy completions of `count` held-out rows by the model in `folder`,
    loaded and run with transformers alone (left-padded batches, the model's chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lit_grpo.rewards.arithmetic import last_integer_score
    from lit_grpo.tasks.chat_sums import ChatSumsOptions, held_out_rows

    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rows = held_out_rows(ChatSumsOptions(), seed=0, count=count)
    correct = 0
    for start in range(0, len(rows), batch_size):
        chunk = rows[start : start + batch_size]
        texts = [
            tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False) for r in chunk
        ]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.inference_mode():
            out = model.generate(
                **batch, max_new_tokens=max_new_tokens, do_sample=False, repetition_penalty=1.0,
                pad_token_id=tokenizer.pad_token_id,
            )  # fmt: skip
        answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        correct += sum(int(last_integer_score(a, r["answer"])) for a, r in zip(answers, chunk))
    return correct, len(rows)


def run_seed(seed: int, out: Path, overrides: list[str], timeout_s: float) -> dict:
    run_dir = out / f"seed{seed}"
    command = [sys.executable, "-m", "lit_grpo.train", f"+experiment={EXPERIMENT}", f"seed={seed}"]
    command += [f"hydra.run.dir={run_dir}", "trainer.enable_progress_bar=false", *overrides]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    (out / f"seed{seed}.log").write_text(done.stdout + done.stderr)
    if done.returncode != 0:
        raise SystemExit(f"seed {seed}: exit {done.returncode}; see {out / f'seed{seed}.log'}")
    summary = json.loads((run_dir / "summary.json").read_text())
    return {"seed": seed, "wall_s": wall, "summary": summary, "final_model": str(run_dir / "final_model")}


def plot_curves(curves: dict[int, list[float]], path: Path) -> None:
    """Each seed's mean reward per step, on one plot."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for seed, curve in curves.items():
        ax.plot(range(1, len(curve) + 1), curve, marker=".", label=f"seed {seed}")
    ax.set_xlabel("step")
    ax.set_ylabel("mean reward of the step's samples")
    ax.set_title(f"+experiment={EXPERIMENT}")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--override", action="append", default=[], help="a Hydra override for every run")
    parser.add_argument("--eval-rows", type=int, default=200)
    parser.add_argument("--max-new-tokens", type=int, default=16, help="the recipe's sampler.max_completion_tokens")
    parser.add_argument("--out", type=Path, default=Path("outputs/bench_smollm2_sums"))
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="one run's deadline")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    from lit_grpo.config.sources import built_model_folder

    base = built_model_folder("HuggingFaceTB/SmolLM2-135M-Instruct")
    if base is None:
        raise SystemExit("SmolLM2-135M-Instruct is not built here: make smollm2")
    runs = []
    for seed in args.seeds:
        run = run_seed(seed, args.out, args.override, args.timeout_s)
        run["export"] = heldout_accuracy(run["final_model"], args.eval_rows, args.max_new_tokens)
        runs.append(run)
        print(f"seed {seed}: {run['wall_s']:.0f} s, summary {json.dumps(run['summary'])[:300]}", flush=True)
    base_correct, n = heldout_accuracy(str(base), args.eval_rows, args.max_new_tokens)
    lines = [
        "| run | wall time | steps | held-out accuracy at step 0 (run) | at the end (run) | "
        "the export, reloaded in transformers | 95 % interval |",
        "|---|---|---|---|---|---|---|",
    ]
    lo, hi = wilson_interval(base_correct, n)
    lines.append(f"| base model | | | | | {base_correct / n:.3f} ({base_correct}/{n}) | {lo:.3f}–{hi:.3f} |")
    finals = []
    for run in runs:
        correct, scored = run["export"]
        lo, hi = wilson_interval(correct, scored)
        s = run["summary"]
        finals.append(correct / scored)
        start, end = s.get("eval_accuracy_start", float("nan")), s.get("eval_accuracy", float("nan"))
        cells = [f"seed {run['seed']}", f"{run['wall_s']:.0f} s", f"{int(s['steps'])}", f"{start:.3f}", f"{end:.3f}"]
        cells += [f"{correct / scored:.3f} ({correct}/{scored})", f"{lo:.3f}–{hi:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    if len(finals) > 1:
        pooled = sum(r["export"][0] for r in runs), sum(r["export"][1] for r in runs)
        lo, hi = wilson_interval(*pooled)
        spread = f"mean {statistics.fmean(finals):.3f}, range {min(finals):.3f}–{max(finals):.3f}"
        lines.append(f"| {len(finals)} seeds | | | | | {spread} | pooled {lo:.3f}–{hi:.3f} |")
    table = "\n".join(lines)
    print(table)
    curves = {r["seed"]: r["summary"].get("reward_curve") for r in runs}
    plot_curves(curves, args.out / "reward_curves.png")
    (args.out / "results.json").write_text(
        json.dumps({"table": table, "runs": runs, "reward_curves": curves}, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
