"""Multi-turn environments.

api.py       the environment API: `Environment` (reset a row into a prompt; step with the
             policy's `Turn`, answered by a `StepResult`), tool calls parsed from a turn
rollout.py   the generic rollout that plays any environment into a `RolloutSample`, with
             limits on turns, tokens and seconds (`rollout.factory: lit_grpo.envs.rollout:make_env_rollout_fn`)
lookup.py    the lookup game's own rollout, with IGPO's per-turn information gains
"""
