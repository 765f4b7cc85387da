"""The policy model: built or loaded, wrapped with LoRA, and its full weights for a sampler.

load.py     a random-init model built locally (tiny, or a real model's shapes), or a Hugging Face one by name
byte_bpe.py a byte-level BPE tokenizer of any vocabulary size (the real-shape model's), built locally
lora.py     peft adapters, the adapter-free reference view, the merged weights a sampler loads
weights.py  the full (unsharded) weights by state-dict name, gathered from FSDP shards
"""
