"""Benchmark: does a tiny random-init model learn to call the calculator tool? Seed by seed.

`+experiment=calculator_tool` (lit_grpo.envs.calculator):

    python -m benchmarks.learning.tool                 # `make bench-tool`: seeds 0 1 2, the experiment's steps
    python -m benchmarks.learning.tool --seeds 0 --max-steps 100
    python -m benchmarks.learning.tool --sampler vllm_server --seeds 0 --max-steps 120   # one CPU vLLM server

Each run is `python -m lit_grpo.train` in a process of its own, one at a time, one torch thread.
For each: the mean reward of the first and the last 10 steps (all rows), and on the rows whose
prompt shows no call (the policy decides) the tool-call rate (`calc/called`) and the solved rate
(`calc/solved`), first and last 10 steps. The table is printed as Markdown and written to `--out`.
`--sampler vllm_server`: the episodes are sampled by one vLLM server the run starts (`SERVER`:
float32, eager, a 64 MB KV cache, the tiny model with 2 heads as vLLM's CPU build needs).
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WINDOW = 10
COLUMNS = {"reward": "reward/mean", "tool calls": "calc/called", "solved": "calc/solved"}
"""Table column -> the metric whose first and last `WINDOW`-step means it shows."""
SERVER = [
    "sampler=vllm_server", "sampler.num_servers=1", "model.num_heads=2", "sampler.dtype=float32",
    "sampler.enforce_eager=true", "sampler.max_model_len=256", "sampler.server_kv_cache_memory_bytes=64M",
]  # fmt: skip
"""The overrides of `--sampler vllm_server`."""


def read_steps(metrics_csv: Path) -> list[dict[str, float]]:
    with open(metrics_csv) as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    return [row for row in rows if "reward/mean" in row and "train/loss" in row]


def first_last(steps: list[dict[str, float]], key: str) -> tuple[float, float]:
    """The mean of `key` over the first and the last `WINDOW` steps (a step without it counts 0)."""
    values = [s.get(key, 0.0) for s in steps]
    return statistics.fmean(values[:WINDOW]), statistics.fmean(values[-WINDOW:])


def run_one(seed: int, max_steps: int | None, root: Path, timeout_s: float, overrides: list[str]) -> dict:
    out = root / f"seed{seed}"
    command = [
        sys.executable, "-m", "lit_grpo.train", "+experiment=calculator_tool", f"seed={seed}", f"output_dir={out}",
        "trainer.enable_progress_bar=false", "output_model_id=null",
        *([f"max_steps={max_steps}"] if max_steps else []), *overrides,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"seed {seed} exited {done.returncode}:\n{done.stderr[-3000:]}")
    steps = read_steps(out / "metrics.csv")
    result = {"seed": seed, "steps": len(steps), "wall_s": time.perf_counter() - start}
    for column, key in COLUMNS.items():
        result[column] = first_last(steps, key)
    return result


def table(results: list[dict]) -> str:
    head = " | ".join(f"{c}, first → last {WINDOW}" for c in COLUMNS)
    lines = [f"| seed | {head} | steps | wall |", "|---|" + "---|" * len(COLUMNS) + "---|---|"]
    for r in results:
        cells = " | ".join(f"{r[c][0]:.3f} → {r[c][1]:.3f}" for c in COLUMNS)
        lines.append(f"| {r['seed']} | {cells} | {r['steps']} | {r['wall_s']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=None, help="default: the experiment's")
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of each run")
    parser.add_argument("--sampler", choices=["hf", "vllm_server"], default="hf", help="the experiment's: hf")
    parser.add_argument("--out", type=Path, default=Path("tool_learning.md"))
    args = parser.parse_args()
    overrides = SERVER if args.sampler == "vllm_server" else []
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            results.append(run_one(seed, args.max_steps, Path(tmp), args.timeout_s, overrides))
            print(table(results[-1:]).splitlines()[-1], flush=True)
    text = table(results)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
