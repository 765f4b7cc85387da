"""lit_grpo against TRL's `GRPOTrainer` (trl 1.16.0, not a lit_grpo dependency), on the same work.

rehearsal.py       `make bench-rehearsal`: the CPU rehearsal (Qwen2.5-0.5B's shapes, cut), s/step and peak RSS
rehearsal_trl.py   the rehearsal's TRL side, run by rehearsal.py (smollm2.py trains TRL through it too)
train_step.py      `make bench-train-step-trl`: one optimizer step on the same fixed rollouts, no sampling
smollm2.py         `make bench-smollm2-trl`: SmolLM2-135M-Instruct's sums, s/step, RSS, held-out accuracy
sampling.py        `python -m benchmarks.vs_trl.sampling`: the sampling phase alone, against TRL's bare generate
"""
