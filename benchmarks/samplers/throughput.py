"""Benchmark: the same training run with each sampler, step time, samples/s and weight-sync time.

    python -m benchmarks.samplers.throughput                      # `make bench-samplers`
    python -m benchmarks.samplers.throughput --steps 60 --samplers hf,server2
    python -m benchmarks.samplers.throughput --experiment smollm2_sums --steps 6 --warmup 1 \
        --samplers hf,vllm,server1 eval_at_start=false data.eval_rows=0 sampler.max_model_len=256  # make smollm2 first

Each sampler runs the arithmetic demo (`model.num_heads=2`, float32), or `--experiment`'s recipe,
for `--steps` steps in a process of its own, one after the other; the medians skip the first `--warmup` steps. The
samplers: `hf` (transformers, in-process), `vllm` (vLLM's engine in-process), `server1` and
`server2` (`sampler=vllm_server` with one or two local vLLM servers the run starts and stops).
Run it with nothing else running: on a few cores the servers, the trainer and any other busy
process compete for the same CPUs.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

SAMPLERS = {
    "hf": ["sampler=hf"],
    "vllm": ["sampler=vllm"],
    "server1": ["sampler=vllm_server", "sampler.num_servers=1", "sampler.server_kv_cache_memory_bytes=64M"],
    "server2": ["sampler=vllm_server", "sampler.num_servers=2", "sampler.server_kv_cache_memory_bytes=64M"],
}
RUN_TIMEOUT_S = 1800


DEMO = ["+experiment=arithmetic", "model.num_heads=2"]


def run(name: str, overrides: list[str], steps: int, root: Path, experiment: list[str] = DEMO) -> Path:
    """One training run; its metrics.csv. A failed run prints its log's tail and exits."""
    out = root / name
    command = [
        sys.executable,
        "-m",
        "lit_grpo.train",
        *experiment,
        "sampler.dtype=float32",
        f"max_steps={steps}",
        "output_model_id=null",
        "trainer.enable_progress_bar=false",
        "callbacks=none",
        f"output_dir={out}",
        f"hydra.run.dir={out}",
        *overrides,
    ]
    log = root / f"{name}.log"
    with open(log, "w") as handle:
        done = subprocess.run(command, stdout=handle, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    if done.returncode != 0:
        sys.exit(f"{name}: the run failed (exit {done.returncode}); the end of its log:\n" + log.read_text()[-3000:])
    return out / "metrics.csv"


def medians(metrics: Path, warmup: int) -> dict[str, float]:
    """Median phase times of the steps after `warmup`, and samples trained per step."""
    group_size = OmegaConf.load(metrics.parent / ".hydra" / "config.yaml").data.completions_per_prompt
    rows = list(csv.DictReader(open(metrics)))[warmup:]

    def median(key: str) -> float:
        values = [float(r[key]) for r in rows if r.get(key)]
        return statistics.median(values) if values else float("nan")

    sampled = [float(r["rollout/groups_accepted"]) * group_size for r in rows if r.get("rollout/groups_accepted")]
    return {
        "steps": len(rows) + warmup,
        "step_s": median("perf/step_s"),
        "sample_s": median("perf/sample_s"),
        "train_s": median("perf/train_s"),
        "sync_s": median("perf/weight_sync_s"),
        "tokens_per_s": median("perf/sample_tokens_per_s"),
        "samples_per_step": statistics.median(sampled) if sampled else float("nan"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--samplers", default=",".join(SAMPLERS), help=f"comma-separated, from {', '.join(SAMPLERS)}")
    parser.add_argument("--experiment", default=None, help="a recipe instead of the demo, e.g. smollm2_sums")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run")
    args = parser.parse_args()
    names = [n.strip() for n in args.samplers.split(",") if n.strip()]
    unknown = [n for n in names if n not in SAMPLERS]
    if unknown:
        parser.error(f"unknown sampler(s) {unknown}; choose from {', '.join(SAMPLERS)}")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            experiment = [f"+experiment={args.experiment}"] if args.experiment else DEMO
            metrics = run(name, SAMPLERS[name] + args.overrides, args.steps, Path(tmp), experiment)
            results[name] = medians(metrics, args.warmup)
            print(f"{name}: done", file=sys.stderr, flush=True)
    what = f"+experiment={args.experiment} (float32)" if args.experiment else "arithmetic demo (num_heads=2, float32)"
    print(f"lit_grpo samplers: {what}, {args.steps} steps, medians after {args.warmup}")
    print(f"{'sampler':<10}{'step s':>9}{'samples/s':>11}{'sample s':>10}{'tokens/s':>10}{'train s':>9}{'sync s':>9}")
    for name, r in results.items():
        rate = r["samples_per_step"] / r["step_s"]
        print(
            f"{name:<10}{r['step_s']:>9.3f}{rate:>11.1f}{r['sample_s']:>10.3f}{r['tokens_per_s']:>10.1f}"
            f"{r['train_s']:>9.3f}{r['sync_s']:>9.4f}"
        )


if __name__ == "__main__":
    main()
