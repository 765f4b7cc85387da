"""The machine itself: its peak, and what lit_grpo reaches on it.

roofline.py    `make bench-roofline`: this CPU's peak matmul FLOP/s (the denominator of `perf/mfu`), cached
gpu_check.sh   `bash benchmarks/machine/gpu_check.sh`: the rehearsal model at Qwen2.5-0.5B's full size on one
               CUDA GPU, variant by variant, then one optimizer step against TRL's (`--dry-run`: CPU, toy width)
gpu_check.py   what gpu_check.sh runs, once it has put Hydra on the path
"""
