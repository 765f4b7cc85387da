"""Multi-turn message-in rollout in the cookbook's style: answer, and when wrong, hear so and retry.

Messages are kept as messages; `MessageTrajectoryAssembler` keeps the sampled tokens as sampled
and tokenizes only the appended user turn, so the trajectory's loss mask is 1 on every assistant
token and 0 on the prompt and the feedback. Each answer ends at a newline (`stop`). The reward is
the last turn's.
"""

from __future__ import annotations

from reward import sum_reward

from lit_grpo.cookbook import (
    MessageTrajectoryAssembler,
    RolloutRun,
    RolloutSample,
    TITOTokenizer,
    build_deployment_sampler,
)

RETRY_PROMPT = "Wrong. Try again."


def make_rollout_fn(setup):
    sampler = build_deployment_sampler(setup)
    tokenizer = setup.tokenizer
    sample_kwargs = dict(setup.sample_kwargs, stop=["\n"])
    max_turns = int(setup.extras.get("max_turns", 2))

    async def rollout_fn(sample_prompt: dict) -> RolloutRun | None:
        messages = list(sample_prompt.get("messages") or [])
        if not messages:
            return None
        assembler = MessageTrajectoryAssembler(TITOTokenizer(tokenizer))
        reward, text, finish_reason = 0.0, "", "stop"
        for _turn in range(max_turns):
            prompt = assembler.prepare_next_input(messages)
            (completion,) = await sampler.sample_with_prompt_tokens(prompt, n=1, **sample_kwargs)
            output = list(completion.full_tokens[completion.prompt_len :])
            if not output:
                return None
            text, finish_reason = completion.text, completion.finish_reason
            answer = {"role": "assistant", "content": text}
            assembler.add_assistant_response(
                request_messages=messages,
                assistant_message=answer,
                prompt_token_ids=prompt,
                completion_token_ids=output,
                completion_logprobs=list(completion.sampling_logprobs),
                finish_reason=finish_reason,
            )
            reward = sum_reward(text, sample_prompt["answer"])
            if reward >= 1.0:
                break
            messages = messages + [answer, {"role": "user", "content": RETRY_PROMPT}]
        tokens, logprobs, loss_mask = assembler.trajectory.to_flat()
        return RolloutRun(
            segments=[RolloutSample(tokens, logprobs, loss_mask, reward, finish_reason=finish_reason, text=text)]
        )

    return rollout_fn
