"""Advantage estimators: how a prompt group's rewards become the advantages the loss weighs.

    registry.py     the registry (`register_advantage`, `get_advantage`, `make_advantage`), `compute` /
                    `compute_batch`, and the uniform-group test every part of the package shares
    estimators.py   the estimators of one reward per sample, each registered where defined: grpo,
                    dr_grpo (the group-relative maths), rloo, batch_std, reinforce_pp, passk, gdpo
    igpo.py         IGPO's turn-level credit (information gains, discounted turn returns), registered as igpo

For one group's scalar rewards, anything can call `compute(name, rewards_G, **params) -> advantages_G`
(`gdpo`: `[G, R]` reward components):

    from lit_grpo.advantages import compute
    compute("rloo", [1.0, 0.0, 0.0, 1.0])        # tensor([ 0.6667, -0.6667, -0.6667,  0.6667])

Pure functions like `lit_grpo.maths`, in the same layer; they import only `lit_grpo.types` and
`lit_grpo.registry`. Importing the package (as importing any of its modules does) registers the
built-ins.
"""

# Imported for their registrations: each estimator registers itself where it is defined.
from lit_grpo.advantages import estimators, igpo  # noqa: F401
from lit_grpo.advantages.estimators import ADVANTAGE_SCALES, group_advantages, ragged_group_advantages
from lit_grpo.advantages.registry import *  # noqa: F403
from lit_grpo.advantages.registry import __all__ as _registry_names

__all__ = [*_registry_names, "ADVANTAGE_SCALES", "group_advantages", "ragged_group_advantages"]
