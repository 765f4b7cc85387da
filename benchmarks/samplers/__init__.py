"""The samplers side by side: the same run with each, and what a weight sync costs.

throughput.py   `make bench-samplers`: hf, vllm, one and two vLLM servers: step time, samples/s, weight sync
lora_sync.py    `make bench-lora-sync`: a LoRA policy's weight sync, the adapter alone against merged weights
"""
