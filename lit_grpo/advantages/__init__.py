"""Advantage estimators: how a prompt group's rewards become the advantages the loss weighs.

    registry.py     the registry (`register_advantage`, `get_advantage`), `compute` / `compute_batch`,
                    the group-relative maths and the built-ins grpo, dr_grpo, rloo, batch_std,
                    reinforce_pp, passk, gdpo, igpo
    estimators.py   the newer estimators' maths (rloo, batch_std, reinforce_pp, passk, gdpo), the uniform-group test
    igpo.py         IGPO's turn-level credit: information gains, discounted turn returns

For one group's scalar rewards, anything can call `compute(name, rewards_G, **params) -> advantages_G`
(`gdpo`: `[G, R]` reward components):

    from lit_grpo.advantages import compute
    compute("rloo", [1.0, 0.0, 0.0, 1.0])        # tensor([ 0.6667, -0.6667, -0.6667,  0.6667])

Pure functions like `lit_grpo.maths`, in the same layer; they import only `lit_grpo.types` and
`lit_grpo.registry`.
"""

# The package's public names are the registry module's, listed once, in its `__all__`.
from lit_grpo.advantages.registry import *  # noqa: F403
from lit_grpo.advantages.registry import __all__  # noqa: F401
