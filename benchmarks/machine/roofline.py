"""Benchmark: this CPU's peak matmul FLOP/s (the denominator of `perf/mfu`), measured and cached.

    python -m benchmarks.machine.roofline       # `make bench-roofline`: float32 and bfloat16, 1 and 2 threads
    python -m benchmarks.machine.roofline --dtypes float32 --threads 1 --repeats 3

For each dtype and thread count, `torch.mm` of each shape of `lit_grpo.run.peak.ROOFLINE_SHAPES`
(a square GEMM, two MLPs and an LM head chunk of the models a CPU trains) runs once to warm up and
then `--repeats` times, within `--budget-s` seconds per dtype and thread count (a shape that would
not fit, at the rate seen so far, is skipped: bfloat16 without AVX512-BF16 or AMX runs at about
1 GFLOP/s); a shape's rate is its median, the peak is the best shape's. Each peak is
written to the cache a run reads (`lit_grpo.run.peak.roofline_cache_path()`, keyed by CPU model,
torch version, dtype and thread count), replacing the quick one-shape measurement a run makes when
it finds none. On cores shared with other work the numbers are lower than the machine's: measure
on an idle machine, or say so next to the numbers.
"""

from __future__ import annotations

import argparse

import torch

from lit_grpo.run.peak import (
    ROOFLINE_BUDGET_S,
    ROOFLINE_SHAPES,
    cache_key,
    cpu_name,
    gemm_flops_per_s,
    roofline_cache_path,
    write_entry,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"]
    )
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--budget-s", type=float, default=ROOFLINE_BUDGET_S)
    args = parser.parse_args()
    path = roofline_cache_path()
    print(f"{cpu_name()}, torch {torch.__version__}; median GFLOP/s of torch.mm [m, k] @ [k, n]; cache: {path}")
    print(
        f"{'dtype':<9} {'threads':>7}  "
        + "  ".join(f"{'x'.join(map(str, s)):>15}" for s in ROOFLINE_SHAPES)
        + "  peak GFLOP/s"
    )
    for name in args.dtypes:
        dtype = getattr(torch, name)
        for threads in args.threads:
            rates = gemm_flops_per_s(dtype, threads, ROOFLINE_SHAPES, repeats=args.repeats, budget_s=args.budget_s)
            entry = write_entry(path, cache_key(dtype, threads), rates, how=f"roofline, median of {args.repeats}")
            cells = "  ".join(f"{rates[s] / 1e9:>15.1f}" if s in rates else f"{'-':>15}" for s in ROOFLINE_SHAPES)
            print(f"{name:<9} {threads:>7}  {cells}  {entry['flops_per_s'] / 1e9:.1f}", flush=True)


if __name__ == "__main__":
    main()
