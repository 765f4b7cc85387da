"""The GPU check: the rehearsal model at Qwen2.5-0.5B's full size (all 24 layers, 151,936 ids) trains
a few GRPO steps on GSM8K rows on one CUDA GPU, bf16 mixed precision, the `hf` sampler generating
on the GPU, once per variant, each in its own process:

    packed         the experiment's micro-batches of 4 sequences, packed into one row each (the default)
    padded         the same micro-batches padded to the step's longest (batching.padding_free=false)
    token_budget   batching.micro_batch_max_tokens, padded (sorted by length, each cut to its own longest row)
    private_copy   the sampler on its own copy of the weights: a real weight sync every step

It prints, per variant, the medians over the steps after the first: seconds per step, sampled and
trained tokens per second, the weight sync's seconds, the padding fraction, and the peak GPU memory.

Then one optimizer step against TRL's `GRPOTrainer` loss path at the full 24 layers
(`benchmarks/vs_trl/train_step.py --device cuda`, float32, 8 ragged completions of at most 1,024 and
4,096 tokens): step seconds, peak and step GPU memory, padding. The GPU machines have no TRL and no
network, so it runs lit_grpo's side alone unless `trl` is importable here, and says which.

    bash benchmarks/machine/gpu_check.sh              # on the GPU machine: under 10 minutes on one H100
    bash benchmarks/machine/gpu_check.sh --dry-run    # the same code on CPU at a toy width (CI runs it)

`--json PATH` also writes the results (with the card's name) as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VARIANTS = {
    "packed": [],
    "padded": ["batching.padding_free=false"],
    "token_budget": [
        "batching.micro_batch_size=0",
        "batching.micro_batch_max_tokens=4096",
        "batching.padding_free=false",
    ],
    "private_copy": ["sampler.share_policy_weights=false"],
}
GPU = [
    "trainer=gpu",  # bf16-mixed: float32 master weights, bf16 autocast
    "model.num_layers=24",  # the whole Qwen2.5-0.5B shape
    "max_steps=4",
    "data.prompt_groups_per_step=4",
    "data.completions_per_prompt=8",  # 32 sequences per step
    "sampler.max_completion_tokens=256",
    "sampler.max_batch_size=32",
]
DRY_RUN = [  # the same code on CPU, at a width a CI host trains in seconds (the vocabulary stays 151,936)
    "trainer=cpu",
    "model.num_layers=1",
    "model.hidden_size=64",
    "model.num_heads=2",
    "model.num_kv_heads=1",
    "model.intermediate_size=128",
    "max_steps=2",
    "data.prompt_groups_per_step=1",
    "data.completions_per_prompt=2",
    "sampler.max_completion_tokens=8",
]
COMMON = [
    "+experiment=rehearsal_0p5b",
    "checkpoint.save_interval=0",
    "logger=none",
    "output_model_id=null",
    "trainer.enable_progress_bar=false",
]
TRAIN_STEP = [  # benchmarks/vs_trl/train_step.py: one optimizer step, lit_grpo (and TRL where importable)
    "--device", "cuda", "--layers", "24", "--max-lengths", "1024", "4096", "--repeats", "1", "--steps", "2",
    "--timeout-s", "150",
]  # fmt: skip
TRAIN_STEP_DRY_RUN = [  # the same code on CPU at a toy width
    "--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "2", "--kv-heads", "1",
    "--max-lengths", "16", "--repeats", "1", "--steps", "1",
]  # fmt: skip
REPORTED = {
    "step_s": "perf/step_s",
    "sample_tokens_per_s": "perf/sample_tokens_per_s",
    "train_tokens_per_s": "perf/train_tokens_per_s",
    "weight_sync_s": "perf/weight_sync_s",
    "padding_frac": "perf/padding_frac",
}


def run_variant(name: str, dry_run: bool) -> dict:
    """Train one variant in this process; its medians (after the first step) and peak memory."""
    import torch

    from lit_grpo.build import fit
    from lit_grpo.run.validate import validate
    from lit_grpo.train import compose_config

    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("gpu_check: no CUDA GPU here; use --dry-run to check the script on CPU")
    with tempfile.TemporaryDirectory() as out:
        overrides = [*COMMON, *(DRY_RUN if dry_run else GPU), *VARIANTS[name], f"output_dir={out}"]
        c = validate(compose_config(overrides))
        start = time.perf_counter()
        _, module = fit(c)
        wall_s = time.perf_counter() - start
    steps = module.step_sequence.history.steps
    after_first = steps[1:] or steps
    result = {
        "variant": name,
        "steps": len(steps),
        "wall_s": wall_s,
        **{key: statistics.median(s.get(name, float("nan")) for s in after_first) for key, name in REPORTED.items()},
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    if torch.cuda.is_available() and not dry_run:
        result["device"] = torch.cuda.get_device_name()
        result["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20
    else:
        result["device"] = "cpu (dry run)"
    return result


def run_train_step(dry_run: bool, timeout_s: float) -> tuple[dict, list[str]]:
    """The train-step comparison against TRL (its own processes); its cases and any failures."""
    import importlib.util

    has_trl = importlib.util.find_spec("trl") is not None
    sides = "lit,trl" if has_trl else "lit"
    print(
        "train step vs TRL's GRPOTrainer (benchmarks/vs_trl/train_step.py): "
        + ("trl is importable: both sides" if has_trl else "trl is not importable here: lit_grpo's side only"),
        flush=True,
    )
    with tempfile.TemporaryDirectory() as out:
        report = Path(out) / "train_step.json"
        step_args = TRAIN_STEP_DRY_RUN if dry_run else TRAIN_STEP
        command = [sys.executable, "-m", "benchmarks.vs_trl.train_step", *step_args]
        command += ["--sides", sides, "--trl-python", sys.executable, "--json", str(report)]
        try:
            proc = subprocess.run(
                command, capture_output=True, text=True, timeout=timeout_s, env=os.environ, cwd=REPO
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            return {"sides": sides}, [f"train_step: did not finish in {timeout_s:.0f} s"]
        print(proc.stdout, end="", flush=True)
        if proc.returncode != 0 or not report.exists():
            return {"sides": sides}, [f"train_step: exit {proc.returncode}\n{proc.stderr[-2000:]}"]
        cases = json.loads(report.read_text())["cases"]
    failures = [
        f"train_step: {side}, max length {case['max_length']}: {run['note']}"
        for case in cases
        for side, runs in case["runs"].items()
        for run in runs
        if run["status"] in ("failed", "timeout")
    ]
    return {"sides": sides, "cases": cases}, failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="CPU, toy width: checks the script, measures nothing")
    parser.add_argument("--variant", choices=sorted(VARIANTS), help="run this one variant here (the parent's child)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--timeout-s", type=float, default=150.0, help="per variant")
    parser.add_argument("--train-step-timeout-s", type=float, default=300.0, help="the train-step comparison")
    parser.add_argument("--skip-train-step", action="store_true", help="leave out the train-step comparison")
    args = parser.parse_args()
    if args.variant:
        print("GPU_CHECK_RESULT " + json.dumps(run_variant(args.variant, args.dry_run)), flush=True)
        return
    results, failures = [], []
    for name in VARIANTS:  # each in its own process: its own peak memory, nothing left over from the last
        command = [sys.executable, __file__, "--variant", name, *(["--dry-run"] if args.dry_run else [])]
        try:
            proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s, env=os.environ)
        except subprocess.TimeoutExpired:
            failures.append(f"{name}: did not finish in {args.timeout_s:.0f} s")
            continue
        lines = [line for line in proc.stdout.splitlines() if line.startswith("GPU_CHECK_RESULT ")]
        if proc.returncode != 0 or not lines:
            failures.append(f"{name}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
            continue
        results.append(json.loads(lines[-1].split(" ", 1)[1]))
    if results:
        memory = "peak_gpu_mib" if "peak_gpu_mib" in results[0] else "peak_rss_mib"
        print(f"gpu_check on {results[0]['device']}: {results[0]['steps']} steps per variant, medians after the first")
        header = ["variant", "s/step", "sample tok/s", "train tok/s", "sync s", "padding", memory]
        print("".join(f"{h:>14}" for h in header))
        for r in results:
            measures = "".join(f"{r[key]:>14.3f}" for key in REPORTED)  # in the header's order
            print(f"{r['variant']:>14}{measures}{r[memory]:>14.0f}")
    train_step: dict = {}
    if not args.skip_train_step:
        train_step, step_failures = run_train_step(args.dry_run, args.train_step_timeout_s)
        failures += step_failures
    if args.json:
        args.json.write_text(json.dumps({"results": results, "failures": failures, "train_step": train_step}, indent=2))
    for failure in failures:
        print(f"gpu_check: variant {failure}", file=sys.stderr)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
