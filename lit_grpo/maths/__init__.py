"""The maths of a step, as pure tensor functions: nothing here knows about Lightning or a config.

losses.py      the policy-loss registry (grpo, dapo, gspo, cispo, ...) and `policy_loss`
trust_region_losses.py  sapo, gmpo, dppo (registered by losses.py): soft gate, geometric mean, divergence mask
loss_terms.py  what every loss shares: ratio, k3 KL, masked means, aggregation
correction.py  training–inference mismatch correction (none, tis, mask, icepop, geo_mask, kl_reject), off-policy mask
entropy.py     the entropy bonus's coefficient (decay, adaptive) and the top-entropy token mask
logprobs.py    selected-token logprobs and entropy (differentiable on demand) without a [B, T, V] float32 temporary
health.py      trainer-sampler drift and the shape of the rollouts, logged every step

The advantage estimators, pure functions too, are their own package beside this one: `lit_grpo.advantages`.
"""
