"""Multi-turn environments: rollout factories (`rollout.factory: module:function`) that play a
task's game with the policy, turn by turn. `lit_grpo.envs.lookup`: the lookup game, with IGPO's
per-turn information gains."""
