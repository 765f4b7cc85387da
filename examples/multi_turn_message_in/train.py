"""Train the arithmetic task with the multi-turn retry rollout of `rollout.py`, on CPU.

    cd examples/multi_turn_message_in && python train.py
    cd examples/multi_turn_message_in && python train.py trainer.fast_dev_run=true rollout.extras.max_turns=2

The chat turns need letters, so the tiny model uses the printable alphabet here.
"""

import sys
from pathlib import Path

from lit_grpo.train import compose_config, train

HERE = Path(__file__).resolve().parent

if __name__ == "__main__":
    sys.path.insert(0, str(HERE))  # so `rollout:make_rollout_fn` and `reward` import from this folder
    cfg = compose_config(
        [
            "+experiment=arithmetic",
            "model.alphabet=printable",
            "sampler.max_completion_tokens=2",
            "rollout.factory=rollout:make_rollout_fn",
            "+rollout.extras.max_turns=3",
            "data.max_seq_len=96",
            f"output_dir={HERE / 'outputs'}",
            *sys.argv[1:],
        ]
    )
    print(train(cfg))
