"""How fast lit_grpo itself trains, on one machine.

step.py             `make bench`: seconds per training step by phase, against a bare-torch floor
async_training.py   `make bench-async`: synchronous against asynchronous training, a latency-bound environment
threads.py          `make bench-threads`: the CPU demo with 1 and 2 torch threads, runs interleaved
packing.py          `make bench-packing`: the training phase, the packing rule against always padded and always packed
profile_step.py     `make bench-profile`: a real model's training phase, prompts shared, whole and padded; its profile
"""
