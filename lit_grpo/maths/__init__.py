"""The maths of a step, as pure tensor functions: nothing here knows about Lightning or a config.

losses.py      the policy-loss registry (grpo, dapo, gspo, cispo, ...) and `policy_loss`
trust_region_losses.py  sapo, gmpo, dppo (registered by losses.py): soft gate, geometric mean, divergence mask
loss_terms.py  what every loss shares: ratio, k3 KL, TIS weights, masked means, aggregation
advantages.py  the advantage registry (grpo, dr_grpo, rloo, batch_std, ...) and group-relative advantages
estimators.py  the newer estimators' maths (rloo, batch_std, reinforce_pp, passk, gdpo), the uniform-group test
igpo.py        IGPO's turn-level credit: information gains, discounted turn returns (the igpo entry)
logprobs.py    selected-token logprobs and entropy without a [B, T, V] float32 temporary
health.py      trainer-sampler drift and the shape of the rollouts, logged every step
"""
