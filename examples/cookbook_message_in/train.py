#!/usr/bin/env python3
"""Multi-turn message-in async RL (`rollout.py`), driven the cookbook's way: `Config` + `main`.

python train.py                     # the tiny CPU model, 96 rows of a+b=
python train.py --max-turns 3
"""

from __future__ import annotations

import argparse
import json

from rollout import make_rollout_fn

from lit_grpo.cookbook import Config, DeployConfig, TrainerConfig, WandBConfig, main


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Multi-turn message-in async RL")
    p.add_argument("--base-model", default="tiny")
    p.add_argument("--log-path", default="./message_in_logs")
    p.add_argument("--max-rows", type=int, default=96)
    p.add_argument("--max-turns", type=int, default=2)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    p.add_argument("--filter-constant-reward", action="store_true")
    return p.parse_args()


if __name__ == "__main__":
    args = parse_args()
    rows = [
        {
            "id": f"sum-{i}",
            "messages": [{"role": "user", "content": f"{i % 10}+{i // 10 % 10}="}],
            "answer": str(i % 10 + i // 10 % 10),
        }
        for i in range(args.max_rows)
    ]
    cfg = Config(
        log_path=args.log_path,
        base_model=args.base_model,
        learning_rate=args.learning_rate,
        kl_beta=0.0,
        completions_per_prompt=4,
        prompt_groups_per_step=3,
        max_completion_tokens=4,
        max_rows=args.max_rows,
        trainer=TrainerConfig(),
        deployment=DeployConfig(tokenizer_model=args.base_model),
        wandb=WandBConfig(),
    )
    dynamic_filter_fn = (lambda pg: len(set(pg.rewards)) > 1) if args.filter_constant_reward else None
    summary = main(
        cfg,
        rollout_fn_factory=make_rollout_fn,
        rows=rows,
        rollout_extras={"max_turns": args.max_turns},
        dynamic_filter_fn=dynamic_filter_fn,
    )
    print(json.dumps(summary))
