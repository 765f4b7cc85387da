"""Benchmark: the training phase with lit_grpo's packing rule against always padding and always packing.

    python -m benchmarks.speed.packing                   # `make bench-packing`: tiny and short, 3 repeats
    python -m benchmarks.speed.packing --shapes smollm2 --repeats 2 --max-steps 6     # make smollm2 first
    python -m benchmarks.speed.packing --shapes tiny --repeats 1 --max-steps 40        # a quick check

Padding-free packing computes no padding but runs one attention call per sequence and layer
(`lit_grpo_segmented_sdpa`); on a tiny model's short rows those calls cost more than the padding
they save. `batching.pack_only_where_it_pays` (the default) decides per micro-batch from the model's
FLOPs (`lit_grpo.maths.packing.PackingCost`). This guards that rule: the default must be no slower
than padding every micro-batch (`batching.padding_free=false`) on any shape here, nor than packing
every one (`batching.pack_only_where_it_pays=false`) where packing pays.

The shapes (every run `trainer.cpu_threads=2`, synchronous, float32):
- `tiny`: TRL's own tiny task, `a+b=` with sums up to 18 (`+experiment=arithmetic task.max_answer=18
  task.num_rows=100`), 8 prompts × 8 completions of at most 4 tokens, β = 0, the reward filter off
  (every group trained, as TRL does);
- `short`: the CPU demo (`+experiment=arithmetic`) with completions of up to 16 tokens, ragged where
  the model ends them;
- `smollm2`: SmolLM2-135M-Instruct's two-digit sums (`+experiment=smollm2_sums`, the folder `make
  smollm2` builds), 4 × 8 chat rows of 46 prompt tokens and up to 16 new ones, the filter off.

Each run is `python -m lit_grpo.train` in a process of its own, the three ways interleaved within each
repeat (default, padded, packed, then the next repeat) so that a drift in the machine's load falls on
all three. Reported per shape and way: the median over the repeats of each run's median
`perf/train_s` (the training phase: forwards, backward, optimizer step) over its steps after
`--warmup`, the repeats' min and max, and the default's ratio to padding and to packing. Run it with
nothing else running.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SHAPES = {
    "tiny": [
        "+experiment=arithmetic", "task.max_answer=18", "task.num_rows=100", "sampler.max_completion_tokens=4",
        "policy_loss.kl_beta=0", "data.prompt_groups_per_step=8", "data.completions_per_prompt=8",
        "callbacks=none",
    ],
    "short": ["+experiment=arithmetic", "sampler.max_completion_tokens=16"],
    "smollm2": [
        "+experiment=smollm2_sums", "eval_at_start=false", "data.eval_rows=0", "callbacks=none",
        "model.gradient_checkpointing=false",
    ],
}  # fmt: skip
"""Each shape's overrides of the run (`--max-steps` and the way's are added)."""
WAYS = {
    "default": [],
    "padded": ["batching.padding_free=false"],
    "packed": ["batching.pack_only_where_it_pays=false"],
}
"""The batching each way runs: lit_grpo's rule, every micro-batch padded, every micro-batch packed."""


def run_one(shape: str, way: str, max_steps: int, out: Path, timeout_s: float) -> list[dict[str, float]]:
    """One run's per-step metrics (`metrics.csv` rows that have `perf/train_s`)."""
    command = [
        sys.executable, "-m", "lit_grpo.train", *SHAPES[shape], *WAYS[way], "trainer.cpu_threads=2",
        f"max_steps={max_steps}", f"output_dir={out}", f"hydra.run.dir={out}", "trainer.enable_progress_bar=false",
        "logger=csv",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{shape}/{way} exited {done.returncode}:\n{done.stderr[-3000:]}")
    with open(out / "metrics.csv", newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("perf/train_s")]
    return [{k: float(v) for k, v in row.items() if v and k.startswith("perf/")} for row in rows]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["tiny", "short"], choices=sorted(SHAPES))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=5, help="first steps of each run left out of its median")
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    results: dict[str, dict[str, list[float]]] = {shape: {way: [] for way in WAYS} for shape in args.shapes}
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as root:
        for shape in args.shapes:
            for repeat in range(args.repeats):
                for way in WAYS:
                    steps = run_one(shape, way, args.max_steps, Path(root) / f"{shape}_{way}_{repeat}", args.timeout_s)
                    kept = [s["perf/train_s"] for s in steps[args.warmup :]] or [s["perf/train_s"] for s in steps]
                    results[shape][way].append(statistics.median(kept))
                    print(f"{shape} {way} repeat {repeat}: train {results[shape][way][-1] * 1e3:.1f} ms", flush=True)
    print(f"\nmedian perf/train_s over each run's steps after the first {args.warmup}; {args.repeats} runs a way\n")
    print("| shape | way | training phase (ms) | min | max | default / this way |")
    print("|---|---|---|---|---|---|")
    for shape, ways in results.items():
        default = statistics.median(ways["default"])
        for way, medians in ways.items():
            median = statistics.median(medians)
            ratio = "" if way == "default" else f"{default / median:.2f}×"
            spread = f"{min(medians) * 1e3:.1f} | {max(medians) * 1e3:.1f}"
            print(f"| {shape} | {way} | {median * 1e3:.1f} | {spread} | {ratio} |")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
