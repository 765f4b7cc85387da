"""Multi-turn environments.

api.py       the environment API: `Environment` (reset a row into a prompt; step with the
             policy's `Turn`, answered by a `StepResult`), tool calls parsed from a turn
rollout.py   the generic rollout that plays any environment into a `RolloutSample`, with
             limits on turns, tokens and seconds (`rollout.factory: lit_grpo.envs.rollout:make_env_rollout_fn`)
checks.py    what an environment returns, checked: a wrong type or value is named as the environment's
             (class, method, file:line) and drops the episode, as one that raises
lookup.py    the lookup game's own rollout, with IGPO's per-turn information gains
"""
