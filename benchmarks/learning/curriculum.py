"""Benchmark: does the curriculum (`curriculum.kind=pools`) learn `+experiment=arithmetic_sums18` faster?

    python -m benchmarks.learning.curriculum                      # both arms, seeds 0 1 2
    python -m benchmarks.learning.curriculum --seeds 0 --max-steps 600

Each run is `python -m lit_grpo.train` in a process of its own (`--parallel` at once, one torch
thread each, like `benchmarks.learning.menu`). The training reward is not comparable between the
arms: the curriculum draws the rows it finds hard more often, which lowers its reward/mean at
equal skill. So each run is also scored by greedy accuracy on 100 held-out rows
(`eval/accuracy`) every `--eval-interval` steps and at the end, the same rows for both arms. The
table gives, per run, the held-out accuracy at each evaluation, the first step whose 10-step mean
training reward reached 0.8, and the seconds of training steps.
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks.learning.menu import read_steps, summarize

ARMS: dict[str, list[str]] = {
    "defaults": [],
    "curriculum.kind=pools": ["curriculum.kind=pools"],
}


def eval_accuracies(metrics_csv: Path) -> list[tuple[int, float]]:
    """`(step, eval/accuracy)` of each evaluation (1-based steps)."""
    with open(metrics_csv) as f:
        return [(int(r["step"]) + 1, float(r["eval/accuracy"])) for r in csv.DictReader(f) if r.get("eval/accuracy")]


def run_one(arm: str, seed: int, max_steps: int, eval_interval: int, root: Path, timeout_s: float) -> dict:
    out = root / f"{arm.replace('=', '_')}_seed{seed}"
    command = [
        sys.executable, "-m", "lit_grpo.train", "+experiment=arithmetic_sums18", f"seed={seed}",
        f"max_steps={max_steps}", f"output_dir={out}", "trainer.enable_progress_bar=false", "output_model_id=null",
        "data.eval_rows=100", f"eval_interval={eval_interval}", *ARMS[arm],
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"{arm} seed {seed} exited {done.returncode}:\n{done.stderr[-3000:]}")
    summary = summarize(read_steps(out / "metrics.csv"))
    return {
        "arm": arm,
        "seed": seed,
        "wall_s": time.perf_counter() - start,
        "evals": eval_accuracies(out / "metrics.csv"),
        "step_s": sum(s.get("perf/step_s", 0.0) for s in read_steps(out / "metrics.csv")),
        **summary,
    }


def table(results: list[dict]) -> str:
    steps = sorted({step for r in results for step, _ in r["evals"]})
    lines = [
        "| arm | seed | " + " | ".join(f"eval acc @ {s}" for s in steps) + " | train 10-step mean ≥ 0.8 at | seconds |",
        "|---|---|" + "---|" * len(steps) + "---|---|",
    ]
    for r in results:
        acc = dict(r["evals"])
        cells = " | ".join(f"{acc[s]:.2f}" if s in acc else "—" for s in steps)
        reached = r["step"] if r["step"] is not None else "never"
        lines.append(f"| {r['arm']} | {r['seed']} | {cells} | {reached} | {r['step_s']:.0f} s |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--max-steps", type=int, default=1200)
    parser.add_argument("--eval-interval", type=int, default=300)
    parser.add_argument("--parallel", type=int, default=2)
    parser.add_argument("--timeout-s", type=float, default=3600.0, help="deadline of each run")
    parser.add_argument("--out", type=Path, default=Path("curriculum_learning.md"))
    args = parser.parse_args()
    jobs = [(arm, seed) for seed in args.seeds for arm in args.arms]
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.parallel) as pool:
        futures = [
            pool.submit(run_one, arm, seed, args.max_steps, args.eval_interval, Path(tmp), args.timeout_s)
            for arm, seed in jobs
        ]
        results = []
        for future in futures:
            results.append(future.result())
            print(results[-1], flush=True)
    text = table(results)
    args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
