"""Benchmark: the CPU demo with one torch thread against two (or any counts), runs interleaved.

    python -m benchmarks.speed.threads                       # `make bench-threads`: 1 vs 2, 5 pairs, 200 steps
    python -m benchmarks.speed.threads --threads 1 2 4 --repeats 3 --max-steps 100

Each run is `python -m lit_grpo.train +experiment=arithmetic trainer.cpu_threads=N max_steps=S` in a process
of its own (OMP_NUM_THREADS unset), one at a time, the counts interleaved (1, 2, 1, 2, ...) so that a change in
the machine's load falls on both. Reported: each count's median training time (the summary's `wall_s`) and
its final reward (the same for every count: the run is reproducible). On cores shared with other work, torch's
intra-op threads wait on each other at every small matmul; `trainer.cpu_threads=null` picks one for a tiny model.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run_one(threads: int, max_steps: int, out: Path, timeout_s: float) -> dict:
    command = [
        sys.executable, "-m", "lit_grpo.train", "+experiment=arithmetic", f"trainer.cpu_threads={threads}",
        f"max_steps={max_steps}", f"output_dir={out}", f"hydra.run.dir={out}", "trainer.enable_progress_bar=false",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL)
    if done.returncode != 0:
        raise RuntimeError(f"threads={threads} exited {done.returncode}:\n{done.stderr[-3000:]}")
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--max-steps", type=int, default=200)
    parser.add_argument("--timeout-s", type=float, default=900)
    args = parser.parse_args()
    walls: dict[int, list[float]] = {n: [] for n in args.threads}
    rewards: dict[int, set[float]] = {n: set() for n in args.threads}
    with tempfile.TemporaryDirectory(prefix="bench_threads_") as root:
        for repeat in range(args.repeats):
            for n in args.threads:
                summary = run_one(n, args.max_steps, Path(root) / f"t{n}_{repeat}", args.timeout_s)
                walls[n].append(summary["wall_s"])
                rewards[n].add(round(summary["final_reward"], 4))
                print(f"threads={n} repeat={repeat} wall_s={summary['wall_s']:.1f}", flush=True)
    print(f"\n{args.max_steps} steps of +experiment=arithmetic, {args.repeats} runs each, interleaved\n")
    print("| torch threads | median training time | min | max | final reward |")
    print("|---|---|---|---|---|")
    for n in args.threads:
        w = walls[n]
        shown = ", ".join(f"{r:.3f}" for r in sorted(rewards[n]))
        print(f"| {n} | {statistics.median(w):.1f} s | {min(w):.1f} s | {max(w):.1f} s | {shown} |")


if __name__ == "__main__":
    main()
