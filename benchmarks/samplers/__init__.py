"""The samplers side by side: the same run with each, what a weight sync costs, and a decode step against its bounds.

throughput.py   `make bench-samplers`: hf, vllm, one and two vLLM servers: step time, samples/s, weight sync
lora_sync.py    `make bench-lora-sync`: a LoRA policy's weight sync, the adapter alone against merged weights
decode_bound.py `make bench-decode`: the hf sampler's decode step on a real model against the memory and compute bounds
"""
