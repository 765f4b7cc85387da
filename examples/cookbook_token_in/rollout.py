"""Token-in rollout in the cookbook's style: a draft, then a final answer in a rewritten context.

Each call samples twice. The second prompt is built from the first answer (the context is
rewritten, not extended), so the trajectory is two trainable segments of one `RolloutRun`; both
carry the run's reward, and training gives both the run's advantage. The reward: 1.0 when the
final answer starts with a digit.
"""

from __future__ import annotations

from lit_grpo.cookbook import RolloutRun, RolloutSample, build_deployment_sampler


def _segment(completion, reward: float) -> RolloutSample:
    """One sampler call as a trainable segment: the prompt masked out, the generated tokens trained."""
    n_prompt = int(completion.prompt_len)
    n_generated = len(completion.full_tokens) - n_prompt
    return RolloutSample(
        tokens=list(completion.full_tokens),
        logprobs=[0.0] * n_prompt + list(completion.sampling_logprobs),
        loss_mask=[0] * n_prompt + [1] * n_generated,
        reward=reward,
        finish_reason=completion.finish_reason,
        text=completion.text,
    )


def make_rollout_fn(setup):
    sampler = build_deployment_sampler(setup)
    tokenizer = setup.tokenizer
    sample_kwargs = dict(setup.sample_kwargs)

    async def rollout_fn(sample_prompt: dict, *, rollout_idx: int = 0) -> RolloutRun | None:
        prompt = list(sample_prompt.get("prompt_token_ids") or [])
        if not prompt:
            return None
        (draft,) = await sampler.sample_with_prompt_tokens(prompt, n=1, **sample_kwargs)
        rewritten = tokenizer(f"draft {draft.text[:2]!r} final:", add_special_tokens=False)["input_ids"]
        (final,) = await sampler.sample_with_prompt_tokens(rewritten, n=1, **sample_kwargs)
        reward = 1.0 if final.text[:1].isdigit() else 0.0
        return RolloutRun(
            segments=[_segment(draft, reward), _segment(final, reward)], run_id=f"{sample_prompt['id']}/{rollout_idx}"
        )

    return rollout_fn
