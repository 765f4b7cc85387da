"""Scoring target tokens on a vLLM OpenAI server: the request body and the reading of its answer.

The server is sent prompt + target as one token-id prompt to `/v1/completions` with vLLM's
`prompt_logprobs=0` extra parameter and `max_tokens=1` (the one generated token is ignored): the
choice's `prompt_logprobs` then holds, per prompt position j, `{token id: {"logprob", ...}}` for
token j itself given the tokens before it (None at position 0). These are computed from the raw
logits, so they are temperature-1 logprobs whatever `--logprobs-mode` the server runs with, and
vLLM does not read the prefix cache for such requests. `echo=True` with `logprobs` would give the
same numbers through `logprobs.token_logprobs`, but detokenizes the whole prompt for its text.
"""

from __future__ import annotations

from typing import Any

from lit_grpo.samplers.server.weight_files import ServerError


def score_request(prompt: list[int], target: list[int]) -> dict[str, Any]:
    """The `/v1/completions` body (without `model` and `n`) that scores `target` after `prompt`."""
    return {
        "prompt": prompt + target,
        "max_tokens": 1,
        "temperature": 1.0,
        "prompt_logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": True,
    }


def target_logprobs(url: str, choice: dict, prompt: list[int], target: list[int]) -> list[float]:
    """The logprob of each target token from a choice answering `score_request(prompt, target)`."""
    row = prompt + target
    per_position = choice.get("prompt_logprobs")
    if not isinstance(per_position, list) or len(per_position) != len(row):
        raise ServerError(
            f"vLLM server {url} answered a scoring request without the prompt logprobs of its "
            f"{len(row)} tokens (a vLLM without the `prompt_logprobs` parameter?)"
        )
    served = choice.get("prompt_token_ids")
    if served is not None and list(served) != row:
        raise ServerError(f"vLLM server {url} scored other tokens than were sent")
    scores = []
    for j in range(len(prompt), len(row)):
        entry = (per_position[j] or {}).get(str(row[j]))  # JSON object keys are strings
        if entry is None or entry.get("logprob") is None:
            raise ServerError(f"vLLM server {url} left out the logprob of prompt token {row[j]} at position {j}")
        scores.append(float(entry["logprob"]))
    return scores
