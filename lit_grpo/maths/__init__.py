"""The maths of a step, as pure tensor functions: nothing here knows about Lightning or a config.

losses.py      `policy_loss`: the shared per-token loss around a variant (correction, KL, entropy), reduced;
               `LossSettings`, what it reads besides tensors; importing it registers the built-ins
loss_registry.py  the policy-loss registry (`register_policy_loss`, `get_policy_loss`)
ppo_losses.py  grpo, dapo, gspo, luspo, cispo, importance_sampling, dro, reinforce, each registered where defined
trust_region_losses.py  sapo, gmpo, dppo, vespo, registered where defined: soft gate, geometric mean,
               divergence mask, Gamma weight of the sequence ratio
loss_terms.py  what every loss shares: ratio, k3 KL, masked means, aggregation
correction.py  training–inference mismatch correction (none, tis, mask, icepop, geo_mask, kl_reject), off-policy mask
entropy.py     the entropy bonus's coefficient (decay, adaptive) and the top-entropy token mask
logprobs.py    selected-token logprobs and entropy (differentiable on demand) without a [B, T, V] float32 temporary
health.py      trainer-sampler drift and the shape of the rollouts, logged every step
flops.py       model FLOPs of a dense transformer's forward, backward, prefill and decode (for `perf/mfu`)
onednn_linear.py  a CPU float32 `linear` through oneDNN for the few-row matmuls of generation

The advantage estimators, pure functions too, are their own package beside this one: `lit_grpo.advantages`.
"""
