"""Train the arithmetic task with the token-in rollout of `rollout.py`, on CPU.

cd examples/single_turn_token_in && python train.py                 # full run
cd examples/single_turn_token_in && python train.py trainer.fast_dev_run=true
"""

import sys
from pathlib import Path

from lit_grpo.train import compose_config, train

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    sys.path.insert(0, str(HERE))  # so `rollout:make_rollout_fn` imports from this folder
    cfg = compose_config(
        [
            "+experiment=arithmetic",
            "rollout.factory=rollout:make_rollout_fn",
            f"output_dir={HERE / 'outputs'}",
            *sys.argv[1:],
        ]
    )
    print(train(cfg))
