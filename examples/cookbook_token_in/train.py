#!/usr/bin/env python3
"""Async RL with the token-in rollout of `rollout.py`, driven the cookbook's way: `Config` + `main`.

python train.py                                # the tiny CPU model, 96 rows
python train.py --base-model /path/to/model    # a local Hugging Face model folder
"""

from __future__ import annotations

import argparse
import json

from rollout import make_rollout_fn

from lit_grpo.cookbook import Config, DeployConfig, main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Token-in async RL (two-segment runs)")
    p.add_argument("--base-model", default="tiny")
    p.add_argument("--log-path", default="./token_in_logs")
    p.add_argument("--max-rows", type=int, default=96)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    cfg = Config(
        log_path=args.log_path,
        base_model=args.base_model,
        learning_rate=args.learning_rate,
        kl_beta=0.0,
        completions_per_prompt=4,
        prompt_groups_per_step=3,
        max_completion_tokens=3,
        max_rows=args.max_rows,
        deployment=DeployConfig(tokenizer_model=args.base_model),
    )
    # Token ids of the tiny model's character vocabulary (ids 8 and up are characters).
    rows = [
        {"id": f"tok-{i}", "prompt_token_ids": [8 + (i * 7 + k) % 60 for k in range(4)]} for i in range(args.max_rows)
    ]
    summary = main(cfg, rollout_fn_factory=make_rollout_fn, rows=rows)
    print(json.dumps(summary))
