"""`python -m lit_grpo.export <checkpoint> <out_dir>`: a checkpoint (or a run's newest) as a Hugging
Face model folder (`lit_grpo/run/export.py` holds it; `--help` lists the options)."""

import sys

import torch

from lit_grpo.run.export import main

if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
