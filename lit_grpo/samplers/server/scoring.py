"""IGPO's scoring over the vLLM servers: the policy's logprob of each target token given a
prompt (`Sampler.score`), one `/v1/completions` request per (prompt, target) pair with the
prompt's logprobs asked for (`answers.score_request`)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from lit_grpo.samplers.arguments import SamplerTimeout, check_score_pairs
from lit_grpo.samplers.server.answers import score_request, target_logprobs
from lit_grpo.samplers.server.host import ServerSamplerState


class ServerScoring(ServerSamplerState):
    """`score` and `score_pairs` of `VLLMServerSampler`, on its client loop and router."""

    async def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """`BatchingSampler.score` over the servers (`answers.score_request`): one request per pair,
        all in flight together on the client's loop, waited for at most `call_timeout_s`. A weight sync
        pauses the servers (`mode=keep`) and resets their prefix cache, so a frozen scoring request
        is recomputed after the reload."""
        checked = check_score_pairs(pairs, self.image_token_ids)
        self._check_open()
        future = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self._score_all(checked), self._loop))
        try:
            return await asyncio.wait_for(future, self.call_timeout_s)
        except TimeoutError:
            raise SamplerTimeout(
                f"{len(checked)} scoring requests to the vLLM servers did not all complete within "
                f"{self.call_timeout_s} s (guards.rollout_timeout_s)"
            ) from None

    def score_pairs(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """`score` from a thread without an event loop (blocking)."""
        checked = check_score_pairs(pairs, self.image_token_ids)
        try:
            return self._run(self._score_all(checked), timeout=self.call_timeout_s)
        except TimeoutError:
            raise SamplerTimeout(
                f"{len(checked)} scoring requests did not complete within {self.call_timeout_s} s"
            ) from None

    async def _score_all(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        async def one(prompt: list[int], target: list[int]) -> list[float]:
            replica, choices = await self.router.complete(score_request(prompt, target), 1, None)
            return target_logprobs(replica.url, choices[0], prompt, target)

        return list(await asyncio.gather(*(one(p, t) for p, t in pairs)))
