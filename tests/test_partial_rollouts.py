"""Partial rollouts' client side without a server (`lit_grpo.samplers.server.partial`): a weight
sync interrupts streams, each completion goes on from its own tokens at the new version, those
with the same tokens so far as one request; transient failures go on from where they were, up to
the retries; the chunks of a stream are read and checked."""

from __future__ import annotations

import asyncio

import pytest

from lit_grpo.samplers.server.answers import PartialChoice, read_chunk
from lit_grpo.samplers.server.partial import InFlightStreams, stream_completions
from lit_grpo.samplers.server.requests import TransientError
from lit_grpo.samplers.server.weight_files import ServerError

PROMPT = [1, 2, 3]
EOS = 0


def _chunk(index, tokens, finish=None):
    return {
        "choices": [
            {
                "index": index,
                "token_ids": tokens,
                "logprobs": {"token_logprobs": [-0.5] * len(tokens)},
                "text": "x" * len(tokens),
                "finish_reason": finish,
            }
        ]
    }


class ScriptedRouter:
    """`stream` runs the next scripted step with (body, choices, version); records every request."""

    retry_backoff_s = 0.0

    def __init__(self, *steps):
        self.steps, self.requests, self.dropped = list(steps), [], []

    async def stream(self, body, choices, version, deadline=None):
        self.requests.append((list(body["prompt"]), body["max_tokens"], len(choices), version))
        await self.steps.pop(0)(body, choices, version)

    def live(self):
        return ["a", "b"]

    async def drop(self, replica, why):
        self.dropped.append(replica)


def _feed(*per_choice, finish=None, then_wait=False):
    async def step(body, choices, version):
        for i, tokens in enumerate(per_choice):
            read_chunk("http://s", _chunk(i, tokens, finish), choices, version, body["prompt"])
        if then_wait:
            await asyncio.sleep(60)

    return step


def _run(router, n, max_tokens, interrupt_after=None, max_retries=2):
    async def main():
        streams = InFlightStreams(version=0)
        task = asyncio.create_task(
            stream_completions(
                router, streams, PROMPT, (1.0, max_tokens, ()), n, None, eos_id=EOS, max_retries=max_retries
            )
        )
        if interrupt_after is not None:
            await asyncio.sleep(interrupt_after)
            assert await streams.interrupt() == 1
            streams.reopen(1)
        return await asyncio.wait_for(task, 10), streams

    return asyncio.run(main())


@pytest.mark.timeout(30)
def test_an_interrupted_completion_goes_on_from_its_own_tokens_at_the_new_version():
    router = ScriptedRouter(
        _feed([5, 6], [7], then_wait=True),  # two choices, cut mid-way by the sync
        _feed([8, 9, 10], finish="length"),  # choice 0 from [5, 6]: 3 more tokens
        _feed([11, EOS], finish="stop"),  # choice 1 from [7]
    )
    (first, second), streams = _run(router, 2, 5, interrupt_after=0.05)
    assert router.requests == [(PROMPT, 5, 2, 0), (PROMPT + [5, 6], 3, 1, 1), (PROMPT + [7], 4, 1, 1)]
    assert first.tokens == [5, 6, 8, 9, 10] and first.versions == [0, 0, 1, 1, 1] and first.finish_reason == "length"
    assert second.tokens == [7, 11, EOS] and second.versions == [0, 1, 1] and second.finish_reason == "stop"
    assert first.requests == 2 and first.whole_text is None and streams.interruptions == 1


@pytest.mark.timeout(30)
def test_completions_with_the_same_tokens_so_far_go_on_as_one_request():
    router = ScriptedRouter(_feed([], [], then_wait=True), _feed([4], [4, EOS], finish="stop"))
    (a, b), _ = _run(router, 2, 3, interrupt_after=0.05)
    # nothing generated before the sync: one request for both, at the new version
    assert router.requests[1] == (PROMPT, 3, 2, 1)
    assert a.versions == [1] and b.versions == [1, 1] and b.finish_reason == "stop"


@pytest.mark.timeout(30)
def test_a_transient_failure_goes_on_from_where_it_was_then_gives_up_after_the_retries():
    async def cut(body, choices, version):
        read_chunk("http://s", _chunk(0, [5]), choices, version, body["prompt"])
        raise TransientError("reset", unreachable=False)

    router = ScriptedRouter(cut, _feed([6, EOS], finish="stop"))
    (c,), _ = _run(router, 1, 8)
    assert c.tokens == [5, 6, EOS] and router.requests[1] == (PROMPT + [5], 7, 1, 0)

    async def fail(body, choices, version):
        raise TransientError("refused", unreachable=False)

    with pytest.raises(ServerError, match="failed 3 times"):
        _run(ScriptedRouter(fail, fail, fail), 1, 8)


def test_read_chunk_refuses_what_it_cannot_train_on():
    choices = [PartialChoice()]
    with pytest.raises(ServerError, match="http://s failed a streamed completion"):
        read_chunk("http://s", {"error": {"message": "boom"}}, choices, 0, PROMPT)
    bad = _chunk(0, [5, 6])
    bad["choices"][0]["logprobs"]["token_logprobs"] = [-0.1]
    with pytest.raises(ServerError, match="2 token ids with 1 logprobs"):
        read_chunk("http://s", bad, choices, 0, PROMPT)
    with pytest.raises(ServerError, match="choice 3"):
        read_chunk("http://s", _chunk(3, [5]), choices, 0, PROMPT)
    other = _chunk(0, [5])
    other["choices"][0]["prompt_token_ids"] = [9]
    with pytest.raises(ServerError, match="other prompt tokens"):
        read_chunk("http://s", other, choices, 0, PROMPT)
