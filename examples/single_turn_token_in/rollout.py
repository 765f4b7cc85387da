"""Single-turn, token-in rollout: one `sample_with_prompt_tokens` call per trajectory.

The prompt is tokenized here, token-in, the way the default rollout does it (`row_prompt_tokens`:
a row's `prompt_token_ids` as they are, its text `prompt` with the tokenizer's special tokens);
the reward is computed inside the rollout.
"""

from lit_grpo.rollouts.rollout import row_prompt_tokens
from lit_grpo.types import RolloutSample


def make_rollout_fn(setup):
    sampler = setup.sampler
    sample_kwargs = dict(setup.sample_kwargs)
    score = setup.extras["reward_fn"]  # (completion_text, row) -> float, from the task config

    async def rollout_fn(row: dict) -> RolloutSample | None:
        completions = await sampler.sample_with_prompt_tokens(
            row_prompt_tokens(row, setup.tokenizer), n=1, **sample_kwargs
        )
        if not completions:
            return None
        c = completions[0]
        generated = len(c.full_tokens) - c.prompt_len
        return RolloutSample(
            tokens=list(c.full_tokens),
            logprobs=[0.0] * c.prompt_len + list(c.sampling_logprobs),
            loss_mask=[0] * c.prompt_len + [1] * generated,
            reward=score(c.text, row),
            finish_reason=c.finish_reason,
            text=c.text,
        )

    return rollout_fn
