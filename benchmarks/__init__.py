"""The benchmarks, one folder per thing measured; not part of the installed package.

    speed/      lit_grpo's own training speed: a step's phases against a bare-torch floor, async, threads
    memory/     peak memory: logprobs, the fused LM head, gradient checkpointing, LoRA
    samplers/   the samplers side by side, and a LoRA policy's weight sync
    learning/   does a run learn, and how fast: the algorithm menu, the curriculum, a tool, SmolLM2's sums
    vs_trl/     lit_grpo against TRL's GRPOTrainer: the CPU rehearsal, one optimizer step, SmolLM2, sampling
    cluster/    the multi-node rehearsal: trainer and inference hosts in network namespaces
    machine/    the machine itself: its peak FLOP/s (the roofline), the GPU check at Qwen2.5-0.5B's full size

Each folder's `__init__.py` lists its modules and the `make` target of each (`make help` names each
target's folder); run them from the repository root, `python -m benchmarks.<folder>.<module>`.
Measured numbers, each with its command, are in docs/results.md.
"""
