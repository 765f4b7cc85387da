"""Multi-turn, message-in rollout: answer, and on a wrong answer hear so and try again.

Each turn is sampled through the chat template (client-side, with the policy's tokenizer). The
environment's "wrong, try again" turns are in the trajectory but not trained on (mask 0); the
assistant turns are (mask 1). A row's `prompt` becomes the first user message.
"""

from reward import turn_reward

from lit_grpo.rollouts.rollout import Trajectory
from lit_grpo.samplers.arguments import chat_prompt_tokens
from lit_grpo.types import RolloutSample

RETRY_MESSAGE = "Wrong, try again."


def make_rollout_fn(setup):
    sampler, tokenizer = setup.sampler, setup.tokenizer
    sample_kwargs = dict(setup.sample_kwargs)
    max_turns = int(setup.extras.get("max_turns", 3))

    async def rollout_fn(row: dict) -> RolloutSample | None:
        trajectory = Trajectory(chat_prompt_tokens(tokenizer, [{"role": "user", "content": row["prompt"]}]))
        reward, text = 0.0, ""
        for turn in range(max_turns):
            (c,) = await sampler.sample_with_prompt_tokens(trajectory.tokens, n=1, **sample_kwargs)
            trajectory.add_completion(c)
            text = c.text
            reward = turn_reward(c.text, row["answer"], turn)
            if reward > 0 or turn == max_turns - 1:
                break
            # The environment's turn, rendered alone by the chat template and appended after the
            # assistant's tokens (templates that inject a default system prompt need their own).
            trajectory.add_environment(chat_prompt_tokens(tokenizer, [{"role": "user", "content": RETRY_MESSAGE}]))
        return trajectory.to_sample(reward, text=text)

    return rollout_fn
