"""Benchmark: SmolLM2-135M-Instruct learns two-digit sums (`+experiment=smollm2_sums`) in lit_grpo and in TRL's
`GRPOTrainer` (trl 1.16.0), side by side on the same work: seconds per optimizer step, peak resident memory,
the held-out greedy accuracy of each side's model after the same number of steps, and both reward curves.

    make bench-smollm2-trl                                            # installs the pinned trl here first
    python -m benchmarks.vs_trl.smollm2                               # 22 steps, 3 pairs, 200 held-out rows
    python -m benchmarks.vs_trl.smollm2 --steps 2 --pairs 1 --eval-rows 20      # a quick check
    python -m benchmarks.vs_trl.smollm2 --sides lit                   # lit_grpo alone

The model is the folder `make smollm2` builds (`lit_grpo.models.load.resolve_model_name`), loaded in
float32 by both sides. Needs trl (not a lit_grpo dependency) and, for the plot, matplotlib.

How it runs. `--pairs` K pairs of runs; pair k trains at seed `--seed` + k on both sides, in
alternating order (lit, trl, then trl, lit, ...) so that a drift in the machine's load falls on both
sides alike. Every run is a process of its own (`--run-side`), so peaks do not mix: its peak RSS is
the process's `ru_maxrss`, read once training and the export of the final model are done (loading,
sampling, training and saving counted; the evaluation after it not). A step's time is the wall time
between the ends of consecutive optimizer steps (lit_grpo's `perf/step_s`; on TRL's side the step
clock of benchmarks/vs_trl/rehearsal_trl.py); the first step, whose figure each side takes its own way, is
left out: each run's figure is the median over its other steps, the table's over those steps of a
side's runs pooled. The paired ratios lit/trl are taken within each pair, then their median. Each
run's exported model is then scored in the same process by
`benchmarks.learning.smollm2_sums.heldout_accuracy` (transformers alone, greedy, the first `--eval-rows` of
chat_sums' held-out pairs, 16 new tokens): the same code for both sides, with a Wilson 95 % interval;
the side's row pools its runs (the same rows each run). Reward curves (mean reward of each step's 32
samples: lit_grpo's `reward/mean`, TRL's logged `reward`) go to `--out` and are drawn on `--plot`.

The same on both sides:

- Rows: lit_grpo's own training rows for the seed (`lit_grpo.tasks.training_rows`: chat_sums draws
  them from the seed), in order: lit_grpo with `data.shuffle=false`, TRL given exactly those rows as a
  `datasets.Dataset` (`prompt`: the row's chat messages, `answer`) with `shuffle_dataset=False`. The
  prompts are the same token ids (SmolLM2's chat template with its default system prompt, the
  generation prompt added, no special tokens added).
- A step: 4 prompts × 8 completions, one forward/backward over all 32 sequences (lit_grpo's
  `batching.micro_batch_size` 0, TRL's `per_device_train_batch_size` 32 with no accumulation), one
  optimizer step per batch of rollouts, synchronous; sampling with the policy itself through
  transformers' `generate`: temperature 0.7, top-p 1, top-k 0, at most 16 new tokens.
- Reward: lit_grpo's `last_integer` (TRL's side calls it through `rehearsal_trl.lit_reward`).
- Every sampled group trains. The recipe's `callbacks.reward_filter` would drop groups of equal rewards
  (all advantages 0) and sample more until 4 groups carry a signal; TRL keeps every group, so lit_grpo
  runs with `callbacks=none` (which also drops the reward plot, histograms and sample log: TRL has none
  of them). Both steps are 32 sequences, whatever their rewards. lit_grpo's forwards and backward
  leave out the rows of advantage 0 (`batching.skip_zero_advantage_rows`, its default: with β = 0 their
  gradient is 0 on both sides, and the loss's token mean still counts their tokens), where TRL
  computes them.
- Advantages: (r - group mean) / (group std + 1e-4), the unbiased std; a uniform group's are 0.
  lit_grpo's `advantage.params.eps` is set to TRL's 1e-4 (the recipe's 1e-8).
- Loss: the clipped ratio with ε = 0.2 both ways, token mean over the whole step (TRL's
  `loss_type="dapo"`), logprobs at the sampling temperature, β = 0: no reference model on either side.
- Optimizer: torch's fused AdamW at lit_grpo's settings (`optim.*`: betas 0.9/0.999, eps 1e-8, weight
  decay 0.01 on every parameter, gradient clip 1.0), learning rate 2e-5 after lit_grpo's linear warm-up
  of 2 steps ((step + 1) / 3: 1/3, 2/3, then 1), constant after it (`optim.lr_decay` constant).
  transformers' `constant_with_warmup` would start at 0 (step / 2: its first step learns nothing),
  and its Trainer exempts norm weights and biases from weight decay: TRL's trainer here is a subclass
  that builds lit_grpo's schedule (`lit_grpo.loop.optim.lr_multiplier`) and decays every parameter.
- 2 torch threads (the recipe's `trainer.cpu_threads`; TRL's process sets `torch.set_num_threads`),
  float32, dropout off, gradient checkpointing off on both (lit_grpo's auto rule would turn it on for
  SmolLM2's 576 × 30: `model.gradient_checkpointing=false`), the same seed.
- No evaluation inside the run (the recipe's `eval_at_start` and `data.eval_rows` are turned off):
  both exports are scored after training by the same code. No checkpoints; both sides save the final
  model (lit_grpo's `final_model/` export, TRL's `save_model` and the tokenizer) inside the measured process.

What differs (each side's own design):

- Sampling. lit_grpo's `sampler=hf` generates with the policy's own weights (no copy, no sync) and
  scores each token as it is drawn (a logits processor: the sampler's logprobs); TRL keeps none.
- Importance weights. lit_grpo's loss multiplies each token by the truncated weight
  min(exp(old - sampler), 5) (`correction=tis`, about 1 here); TRL uses none without vLLM.
- Logits. lit_grpo packs the 32 sequences into one row without padding (`batching.padding_free`) and
  runs the LM head from the first completion column, then its chunked log-softmax; TRL pads the rows
  (prompts on the left) and computes the completion's logprobs with its fused LM head, in chunks.
- Trainer loop and bookkeeping: Lightning with lit_grpo's rollout engine and health metrics against
  transformers' Trainer with TRL's metrics; neither's logging is switched off.
- Random streams: the same seed, but each side draws its samples its own way, so the two runs of a
  pair see different completions of the same prompts: their curves and accuracies differ by chance
  too (the interval covers only the held-out rows' binomial noise, not the run's).

The numbers depend on the machine: run it with nothing else running.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

from benchmarks.learning.smollm2_sums import EXPERIMENT, heldout_accuracy, wilson_interval
from benchmarks.vs_trl.rehearsal import peak_rss_gib, run_logged, step_summary, train_lit, versions

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
SIDES = {"lit": "lit_grpo", "trl": "trl"}
WARMUP = 1
"""Steps of each run left out of its median (the first: warm caches, the first allocations)."""
TRL_EPS = 1e-4
"""TRL's advantage denominator: (r - mean) / (std + 1e-4) (`grpo_trainer.py`); lit_grpo's is set to it."""


def lit_overrides(seed: int, steps: int) -> list[str]:
    """The recipe at this seed and length, with what the module docstring makes equal to TRL's side."""
    return [
        f"+experiment={EXPERIMENT}",
        f"seed={seed}",
        f"max_steps={steps}",
        "data.shuffle=false",  # the rows in order, as TRL's side takes them
        "callbacks=none",  # no uniform-reward filter: every sampled group trains, as in TRL
        f"advantage.params.eps={TRL_EPS}",
        "model.gradient_checkpointing=false",  # its auto rule turns it on for SmolLM2 (576 x 30 >= 16,384)
        "eval_at_start=false",  # both exports are scored after the run by the same code
        "data.eval_rows=0",
        "checkpoint.save_interval=0",
        "resume=null",
        "logger=csv",
        "trainer.enable_progress_bar=false",
    ]


def lit_config(seed: int, steps: int, work_dir: Path):
    """lit_grpo's validated config of the run (TRL's side reads its rows and settings from it)."""
    from lit_grpo.run.validate import validate
    from lit_grpo.train import compose_config

    return validate(compose_config([*lit_overrides(seed, steps), f"output_dir={work_dir}"]))


def check_matched(c) -> None:
    """Stop when the recipe has moved away from what TRL's side is set to (grpo_config's fixed fields)."""
    expected = {
        "policy_loss.name": (c.policy_loss.name, "grpo"),
        "policy_loss.loss_normalization": (c.policy_loss.loss_normalization, "token_mean"),
        "policy_loss.params.eps_clip": (c.policy_loss.params.get("eps_clip"), 0.2),
        "policy_loss.params.eps_clip_high": (c.policy_loss.params.get("eps_clip_high"), 0.2),
        "advantage.name": (c.advantage.name, "grpo"),
        "optim.lr_decay": (c.optim.lr_decay, "constant"),
        "batching.ppo_minibatches": (c.batching.ppo_minibatches, 1),
        "batching.micro_batch_size": (c.batching.micro_batch_size, 0),
        "offpolicy.synchronous": (c.offpolicy.synchronous, True),
        "rollout.mask_truncated": (c.rollout.mask_truncated, False),
        "model.dtype": (c.model.dtype, "float32"),
    }
    moved = [f"{k}={got!r} (TRL's side: {want!r})" for k, (got, want) in expected.items() if got != want]
    if moved:
        raise SystemExit(f"{EXPERIMENT} no longer matches TRL's side: " + "; ".join(moved))


def last_integer_reward(prompts, completions, answer, **kwargs) -> list[float]:
    """lit_grpo's `last_integer` reward of each completion (the TRL side's reward function)."""
    from benchmarks.vs_trl.rehearsal_trl import lit_reward

    return lit_reward("last_integer", completions, answer)


def run_lit(seed: int, steps: int, work_dir: Path) -> dict:
    """lit_grpo's side, in this process: the recipe through `train`; its steps and rewards from metrics.csv."""
    start = time.perf_counter()
    column = train_lit(lit_overrides(seed, steps), work_dir)
    return {
        **step_summary(column("perf/step_s"), WARMUP),
        "sample_s": column("perf/sample_s"),
        "reward_curve": column("reward/mean"),
        "lr_logged": column("train/lr"),
        "train_wall_s": time.perf_counter() - start,
        "export": str(work_dir / "final_model"),
    }


def run_trl(seed: int, steps: int, work_dir: Path) -> dict:
    """TRL's side, in this process: lit_grpo's rows and settings for the seed, TRL's trainer, the export."""
    import torch
    from datasets import Dataset
    from torch.optim.lr_scheduler import LambdaLR
    from trl import GRPOTrainer

    from benchmarks.vs_trl.rehearsal import Settings
    from benchmarks.vs_trl.rehearsal_trl import grpo_config, timed_training
    from lit_grpo.loop.optim import lr_multiplier
    from lit_grpo.models.load import load_tokenizer, resolve_model_name, with_resolved_model
    from lit_grpo.tasks import training_rows

    work_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    c = lit_config(seed, steps, work_dir)
    check_matched(c)
    if c.trainer.cpu_threads:
        torch.set_num_threads(c.trainer.cpu_threads)
    rows = training_rows(c)
    dataset = Dataset.from_list([{"prompt": row["messages"], "answer": row["answer"]} for row in rows])
    tokenizer = load_tokenizer(with_resolved_model(c.model))
    o, sequences = c.optim, c.data.prompt_groups_per_step * c.data.completions_per_prompt
    settings = Settings(
        steps=c.max_steps,
        warmup=WARMUP,
        prompts=c.data.prompt_groups_per_step,
        group=c.data.completions_per_prompt,
        tokens=c.sampler.max_completion_tokens,
        micro_batch=sequences,  # one forward/backward of the whole step, as lit_grpo's micro_batch_size 0
        learning_rate=c.learning_rate,
        kl_beta=c.policy_loss.kl_beta,
        dtype=c.model.dtype,
        seed=c.seed,
        trl_args={
            "temperature": c.sampler.temperature,
            "weight_decay": o.weight_decay,
            "adam_beta1": o.adam_beta1,
            "adam_beta2": o.adam_beta2,
            "adam_epsilon": o.adam_eps,
            "max_grad_norm": o.grad_clip_norm,
            "disable_tqdm": True,  # lit_grpo's side runs without its progress bar
        },
    )

    class LitOptimTrainer(GRPOTrainer):
        """TRL's trainer with lit_grpo's learning-rate schedule and weight decay on every parameter."""

        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                multiplier = partial(
                    lr_multiplier, warmup_steps=o.warmup_steps, decay=o.lr_decay, total_steps=num_training_steps
                )
                self.lr_scheduler = LambdaLR(optimizer or self.optimizer, multiplier)
            return self.lr_scheduler

        def get_decay_parameter_names(self, model) -> list[str]:
            return [name for name, _ in model.named_parameters()]

    trainer, clock = timed_training(
        LitOptimTrainer,
        model=resolve_model_name(c.model.name_or_path),
        reward_funcs=last_integer_reward,
        args=grpo_config(settings, work_dir / "trainer"),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    export = work_dir / "final_model"
    trainer.save_model(str(export))
    tokenizer.save_pretrained(export)
    log = trainer.state.log_history
    return {
        **step_summary(clock.seconds, WARMUP),
        "sample_s": clock.sampling,
        "reward_curve": [entry["reward"] for entry in log if "reward" in entry],
        "lr_logged": [entry["learning_rate"] for entry in log if "learning_rate" in entry],
        "train_wall_s": time.perf_counter() - start,
        "export": str(export),
    }


def run_side(side: str, seed: int, steps: int, eval_rows: int, max_new_tokens: int, work_dir: Path) -> dict:
    """One run in this process: train, read the peak RSS, then score the export (and delete it)."""
    result = (run_lit if side == "lit" else run_trl)(seed, steps, work_dir)
    result.update(side=SIDES[side], seed=seed, peak_rss_gib=peak_rss_gib(), versions=versions())
    correct, scored = heldout_accuracy(result["export"], eval_rows, max_new_tokens)
    result.update(correct=correct, scored=scored)
    return result


def pair_orders(sides: list[str], pairs: int) -> list[list[str]]:
    """The sides' order in each pair: as given, then reversed, alternating."""
    return [list(sides) if k % 2 == 0 else list(reversed(sides)) for k in range(pairs)]


def accuracy_cell(correct: int, scored: int) -> tuple[str, str]:
    lo, hi = wilson_interval(correct, scored)
    return f"{correct / scored:.3f} ({correct}/{scored})" if scored else "-", f"{lo:.3f}–{hi:.3f}"


def side_rows(runs: list[dict], sides: list[str]) -> list[str]:
    """The side table: pooled step times (after each run's first), the largest peak RSS, pooled accuracy."""
    lines = [
        "| side | median s/step | min | max | peak RSS GiB | held-out accuracy | 95 % interval |",
        "|---|---|---|---|---|---|---|",
    ]
    for side in sides:
        mine = [r for r in runs if r["side"] == SIDES[side]]
        steps = [s for r in mine for s in (r["step_s"][WARMUP:] or r["step_s"])]
        correct, scored = sum(r["correct"] for r in mine), sum(r["scored"] for r in mine)
        accuracy, interval = accuracy_cell(correct, scored)
        cells = [SIDES[side], f"{statistics.median(steps):.2f}", f"{min(steps):.2f}", f"{max(steps):.2f}"]
        cells += [f"{max(r['peak_rss_gib'] for r in mine):.2f}", accuracy, interval]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def paired_ratios(runs: list[dict]) -> list[dict]:
    """lit/trl of each pair: its runs' median s/step and peak RSS."""
    ratios = []
    for pair in sorted({r["pair"] for r in runs}):
        both = {r["side"]: r for r in runs if r["pair"] == pair}
        if len(both) == 2:
            lit, trl = both[SIDES["lit"]], both[SIDES["trl"]]
            ratios.append(
                {
                    "pair": pair,
                    "seed": lit["seed"],
                    "step_s": lit["step_s_median"] / trl["step_s_median"],
                    "peak_rss": lit["peak_rss_gib"] / trl["peak_rss_gib"],
                }
            )
    return ratios


def pair_rows(runs: list[dict], ratios: list[dict]) -> list[str]:
    """The per-pair table: each run's median s/step, peak RSS and accuracy, and the pair's ratios."""
    lit_name, trl_name = SIDES["lit"], SIDES["trl"]
    lines = [
        f"| pair | seed | order | {lit_name} s/step | {trl_name} s/step | lit/trl s/step | {lit_name} RSS GiB | "
        f"{trl_name} RSS GiB | lit/trl RSS | {lit_name} accuracy | {trl_name} accuracy |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for ratio in ratios:
        both = {r["side"]: r for r in runs if r["pair"] == ratio["pair"]}
        lit, trl = both[lit_name], both[trl_name]
        order = ", ".join(r["side"] for r in sorted(both.values(), key=lambda r: r["order"]))
        cells = [str(ratio["pair"]), str(ratio["seed"]), order]
        cells += [f"{lit['step_s_median']:.2f}", f"{trl['step_s_median']:.2f}", f"{ratio['step_s']:.2f}"]
        cells += [f"{lit['peak_rss_gib']:.2f}", f"{trl['peak_rss_gib']:.2f}", f"{ratio['peak_rss']:.2f}"]
        cells += [accuracy_cell(lit["correct"], lit["scored"])[0], accuracy_cell(trl["correct"], trl["scored"])[0]]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot_reward_curves(runs: list[dict], sides: list[str], path: Path) -> None:
    """Each run's mean reward per step, thin, and each side's mean over its runs, thick, on one plot."""
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed: no plot written to {path}")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    for side, colour in zip(sides, ("tab:blue", "tab:orange")):
        curves = [r["reward_curve"] for r in runs if r["side"] == SIDES[side] and r["reward_curve"]]
        for curve in curves:
            ax.plot(range(1, len(curve) + 1), curve, color=colour, alpha=0.3, linewidth=1)
        steps = min(len(c) for c in curves) if curves else 0
        if steps:
            mean = [statistics.fmean(c[i] for c in curves) for i in range(steps)]
            label = f"{SIDES[side]}, mean of {len(curves)} run{'s' if len(curves) > 1 else ''}"
            ax.plot(range(1, steps + 1), mean, color=colour, linewidth=2.2, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("mean reward of the step's samples")
    ax.set_title(f"SmolLM2-135M-Instruct, {EXPERIMENT}: {' and '.join(SIDES[s] for s in sides)}", fontsize=10)
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"reward curves drawn in {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=22, help="optimizer steps of every run (the recipe's max_steps)")
    parser.add_argument("--pairs", type=int, default=3, help="pairs of runs; pair k runs seed --seed + k")
    parser.add_argument("--eval-rows", type=int, default=200, help="held-out rows each export is scored on")
    parser.add_argument("--max-new-tokens", type=int, default=16, help="the recipe's sampler.max_completion_tokens")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("results/smollm2_vs_trl.json"))
    parser.add_argument("--plot", type=Path, default=Path("docs/img/smollm2_vs_trl_reward.png"))
    parser.add_argument("--sides", default="lit,trl", help="comma-separated: lit, trl")
    parser.add_argument("--keep", action="store_true", help="keep the runs' folders (logs, metrics, exports)")
    # One run in this process (what the driver runs in a subprocess).
    parser.add_argument("--run-side", choices=sorted(SIDES), help=argparse.SUPPRESS)
    parser.add_argument("--work-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.run_side:
        result = run_side(args.run_side, args.seed, args.steps, args.eval_rows, args.max_new_tokens, args.work_dir)
        if not args.keep:
            shutil.rmtree(result["export"], ignore_errors=True)  # a float32 copy of the model each run
        args.result.write_text(json.dumps(result))
        return 0

    if args.steps < 1 or args.pairs < 1 or args.eval_rows < 1:
        raise SystemExit("--steps, --pairs and --eval-rows must be >= 1")
    sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    if not sides or any(s not in SIDES for s in sides) or len(set(sides)) != len(sides):
        raise SystemExit(f"--sides: {args.sides!r}; give lit, trl or both, comma-separated")
    from lit_grpo.config.sources import built_model_folder

    if built_model_folder(MODEL) is None:
        raise SystemExit(f"{MODEL} is not built here: make smollm2")
    root = Path(tempfile.mkdtemp(prefix="smollm2-vs-trl-"))
    runs = []
    for pair, order in enumerate(pair_orders(sides, args.pairs)):
        seed = args.seed + pair
        for position, side in enumerate(order):
            name = f"pair{pair}_{side}"
            print(f"pair {pair} (seed {seed}): {SIDES[side]} ... (log: {root / (name + '.log')})", flush=True)
            command = [sys.executable, "-m", "benchmarks.vs_trl.smollm2", "--run-side", side, "--seed", str(seed)]
            command += ["--steps", str(args.steps), "--eval-rows", str(args.eval_rows)]
            command += ["--max-new-tokens", str(args.max_new_tokens), "--work-dir", str(root / name)]
            command += ["--result", str(root / f"{name}.json"), *(["--keep"] if args.keep else [])]
            run = run_logged(SIDES[side], command, root / f"{name}.json", root / f"{name}.log")
            runs.append({**run, "pair": pair, "order": position})
            print(
                f"  {run['step_s_median']:.2f} s/step, peak RSS {run['peak_rss_gib']:.2f} GiB, "
                f"held-out accuracy {run['correct']}/{run['scored']}",
                flush=True,
            )

    ratios = paired_ratios(runs)
    header = (
        f"SmolLM2-135M-Instruct, +experiment={EXPERIMENT}: {args.steps} steps of 4 prompts x 8 completions; "
        f"{args.pairs} pair(s), seeds {args.seed}..{args.seed + args.pairs - 1}; s/step over each run's steps "
        f"after the first, pooled; accuracy greedy on {args.eval_rows} held-out rows, pooled over the runs"
    )
    lines = [header, "", *side_rows(runs, sides)]
    if ratios:
        lines += ["", *pair_rows(runs, ratios), ""]
        lines.append(
            f"lit/trl, median over {len(ratios)} pair(s): s/step {statistics.median(r['step_s'] for r in ratios):.2f}, "
            f"peak RSS {statistics.median(r['peak_rss'] for r in ratios):.2f}"
        )
    lines.append("versions: " + ", ".join(f"{k} {v}" for k, v in runs[0]["versions"].items()))
    table = "\n".join(lines)
    print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("steps", "pairs", "eval_rows", "max_new_tokens", "seed")}
    curves = {SIDES[s]: [r["reward_curve"] for r in runs if r["side"] == SIDES[s]] for s in sides}
    args.out.write_text(
        json.dumps(
            {"settings": {**settings, "sides": sides}, "table": table, "ratios": ratios, "reward_curves": curves,
             "runs": runs},
            indent=1,
        )
    )  # fmt: skip
    print(f"results written to {args.out}")
    plot_reward_curves(runs, sides, args.plot)
    if args.keep:
        print(f"runs kept in {root}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
