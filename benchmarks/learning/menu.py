"""Benchmark: how the algorithm menu learns `+experiment=arithmetic_sums18`, arm by arm, seed by seed.

    python -m benchmarks.learning.menu                       # `make bench-menu`: every arm, seeds 0 1 2
    python -m benchmarks.learning.menu --arms defaults rloo --seeds 0 --max-steps 600

Each arm is a set of Hydra overrides on the experiment; each run is `python -m lit_grpo.train` in a
process of its own (`--parallel` at once, one torch thread each, so the seconds are comparable
within one invocation only). For each run: the first step whose 10-step mean reward reaches 0.8
and the seconds of training steps until then (the sum of `perf/step_s`), and the mean reward of
the last 50 steps. The table is printed as Markdown and written to `--out`.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ARMS: dict[str, list[str]] = {
    "defaults": [],
    "correction=mask": ["correction=mask"],
    "advantage=rloo": ["advantage=rloo"],
    "advantage=dr_grpo": ["advantage=dr_grpo"],
    "entropy.coef=0.001": ["entropy.coef=0.001"],
}
"""Arm name -> its overrides (`defaults`: the shipped config, `correction=tis` at cap 5)."""

WINDOW, THRESHOLD, FINAL = 10, 0.8, 50


def summarize(steps: list[dict[str, float]]) -> dict[str, float | None]:
    """The first step (1-based) whose trailing `WINDOW`-step mean reward reaches `THRESHOLD`, the
    seconds of steps until then, and the mean reward of the last `FINAL` steps."""
    rewards = [s["reward/mean"] for s in steps]
    seconds = [s.get("perf/step_s", 0.0) for s in steps]
    means = [statistics.fmean(rewards[i + 1 - WINDOW : i + 1]) for i in range(WINDOW - 1, len(rewards))]
    reached = next((i + WINDOW for i, mean in enumerate(means) if mean >= THRESHOLD), None)
    return {
        "step": reached,
        "seconds": sum(seconds[:reached]) if reached else None,
        "final": statistics.fmean(rewards[-FINAL:]) if rewards else float("nan"),
        "steps": len(rewards),
    }


def read_steps(metrics_csv: Path) -> list[dict[str, float]]:
    with open(metrics_csv) as f:
        rows = [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
    return [row for row in rows if "reward/mean" in row and "train/loss" in row]


def run_one(arm: str, seed: int, max_steps: int, root: Path, timeout_s: float) -> dict:
    out = root / f"{arm.replace('=', '_')}_seed{seed}"
    command = [
        sys.executable, "-m", "lit_grpo.train", "+experiment=arithmetic_sums18", f"seed={seed}",
        f"max_steps={max_steps}", f"output_dir={out}", "trainer.enable_progress_bar=false", "output_model_id=null",
        *ARMS[arm],
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} exited {done.returncode}:\n{done.stderr[-3000:]}")
    summary = summarize(read_steps(out / "metrics.csv"))
    return {"arm": arm, "seed": seed, "wall_s": time.perf_counter() - start, **summary}


def table(results: list[dict]) -> str:
    lines = [
        f"| arm | seed | 10-step mean ≥ {THRESHOLD} at step | seconds of steps until then "
        f"| last-{FINAL} mean | steps |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        step = r["step"] if r["step"] is not None else "never"
        seconds = f"{r['seconds']:.0f} s" if r["seconds"] is not None else "—"
        lines.append(f"| {r['arm']} | {r['seed']} | {step} | {seconds} | {r['final']:.3f} | {r['steps']} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=1500)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of each run")
    parser.add_argument("--out", type=Path, default=Path("menu_learning.md"))
    args = parser.parse_args()
    jobs = [(arm, seed) for arm in args.arms for seed in args.seeds]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        futures = [pool.submit(run_one, arm, seed, args.max_steps, Path(tmp), args.timeout_s) for arm, seed in jobs]
        results = []
        for future in futures:
            results.append(future.result())
            print(table(results[-1:]).splitlines()[-1], flush=True)
    text = table(results)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
