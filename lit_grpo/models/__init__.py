"""The policy model: built or loaded, wrapped with LoRA, and its full weights for a sampler.

load.py     a tiny random-init model and character tokenizer built locally, or a Hugging Face one by name
lora.py     peft adapters, the adapter-free reference view, the merged weights a sampler loads
weights.py  the full (unsharded) weights by state-dict name, gathered from FSDP shards
"""
