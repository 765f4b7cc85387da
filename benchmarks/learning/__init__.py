"""Does a run learn, and how fast: seeds side by side, each run in a process of its own.

menu.py           `make bench-menu`: the algorithm menu on arithmetic_sums18, arm by arm
curriculum.py     `python -m benchmarks.learning.curriculum`: the curriculum against none, held-out accuracy
tool.py           `make bench-tool`: a tiny model learns to call the calculator tool
smollm2_sums.py   `make bench-smollm2-sums`: SmolLM2-135M-Instruct learns two-digit sums; each export scored again
"""
