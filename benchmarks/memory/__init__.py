"""Peak memory, each case in a process of its own.

logprobs.py        `make bench-memory`: selected-token logprobs + entropy, naive against chunked
fused_head.py      `make bench-train-memory`: a training step at Qwen2.5's vocabulary, fused LM head on and off
checkpointing.py   `python -m benchmarks.memory.checkpointing`: a training step, gradient checkpointing off and on
lora.py            `python -m benchmarks.memory.lora`: a LoRA run against a full fine-tune, the KL term on
cap.py             not a benchmark: a memory cap for a benchmark's child process (used by vs_trl/train_step.py)
"""
