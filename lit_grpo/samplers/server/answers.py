"""The requests lit_grpo sends a vLLM OpenAI server, and the reading of their answers: the served
model (`/v1/models`), a completion's token ids and logprobs (whole, or streamed chunk by chunk),
and the logprobs of target tokens.

A completion asks for the token ids (`return_token_ids`) and the sampled tokens' logprobs
(`logprobs=0`), untruncated (`top_p=1`, `top_k=0`). For scoring, the server is sent prompt +
target as one token-id prompt to `/v1/completions` with vLLM's `prompt_logprobs=0` extra
parameter and `max_tokens=1` (the one generated token is ignored): the
choice's `prompt_logprobs` then holds, per prompt position j, `{token id: {"logprob", ...}}` for
token j itself given the tokens before it (None at position 0). These are computed from the raw
logits, so they are temperature-1 logprobs whatever `--logprobs-mode` the server runs with, and
vLLM does not read the prefix cache for such requests. `echo=True` with `logprobs` would give the
same numbers through `logprobs.token_logprobs`, but detokenizes the whole prompt for its text.

A prompt with images goes to `/inference/v1/generate` instead (`generate_request`): the OpenAI
completions route takes no images. It is sent the prompt as the chat template made it, one
placeholder per image, with the images as PNG data URIs, and answers the prompt as its own
processor expanded it, which must be the policy's (`read_generated`).
"""

from __future__ import annotations

import base64
import io
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Optional

from lit_grpo.samplers.server.weight_files import ServerError


async def describe_replica(call: Callable[..., Awaitable[Any]], r: Any, timeout: float) -> None:
    """Set replica `r`'s served model name and length limit from its `/v1/models`."""
    data = await call(r, "GET", "/v1/models", timeout=timeout)
    models = data.get("data") or []
    if not models:
        raise ServerError(f"vLLM server {r.url} serves no model (/v1/models is empty)")
    r.model, r.max_model_len = models[0]["id"], models[0].get("max_model_len")


def completion_request(
    prompt: list[int], temperature: float, max_tokens: int, stop: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The `/v1/completions` body (without `model` and `n`) that samples a completion of `prompt`."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": 0,
        "logprobs": 0,
        "return_token_ids": True,
        "skip_special_tokens": True,
    }
    if stop:
        body["stop"] = list(stop)
    return body


GENERATE_PATH = "/inference/v1/generate"
"""vLLM's token-in, token-out route (`--enable-scale-out`): the one that takes a prompt's token ids
together with its images, for a vision-language policy."""


def image_content_parts(images: list) -> list[dict[str, str]]:
    """The `content_parts` of a `/inference/v1/generate` request: each PIL image as a PNG data URI
    (lossless: the server's processor reads the pixels the policy's processor read)."""
    parts = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format="PNG")
        parts.append(
            {"type": "image_url", "url": "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()}
        )
    return parts


def generate_request(
    engine_prompt: list[int],
    content_parts: list[dict[str, str]],
    temperature: float,
    max_tokens: int,
    stop: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The `/inference/v1/generate` body (without `model` and `n`) that samples a completion of a
    prompt with images: `engine_prompt` holds one placeholder per image (`PromptImages.engine_prompt`),
    which the server expands, returning the expanded prompt (`return_token_ids`) to check."""
    params: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": 1.0,
        "top_k": 0,
        "logprobs": 0,
    }
    if stop:
        params["stop"] = list(stop)
    return {
        "token_ids": engine_prompt,
        "content_parts": content_parts,
        "sampling_params": params,
        "return_token_ids": True,
    }


def read_generated(url: str, prompt: list[int], choice: dict) -> tuple[list[int], list[float], None, Optional[str]]:
    """A choice answering `generate_request` as `read_completion`'s tuple, its text None (the route
    answers token ids; the sampler decodes them). `ServerError` naming `url` when a part is missing
    or the server's expansion of the images is not the policy processor's (`prompt`)."""
    tokens = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    logprobs = [c.get("logprob") for c in content] if isinstance(content, list) else None
    if tokens is None or logprobs is None or len(tokens) != len(logprobs) or any(lp is None for lp in logprobs):
        raise ServerError(
            f"vLLM server {url} answered {GENERATE_PATH} without the token ids and logprobs of its completion"
        )
    served = choice.get("prompt_token_ids")
    if served is not None and list(served) != prompt:
        raise ServerError(
            f"vLLM server {url} expanded the prompt's images into {len(served)} tokens where the policy's "
            f"processor made {len(prompt)}: the server and the policy read the images differently (is the "
            "served model folder's preprocessor_config.json the policy's processor?)"
        )
    stop_reason = choice.get("stop_reason")
    return list(tokens), [float(lp) for lp in logprobs], None, stop_reason if isinstance(stop_reason, str) else None


def read_completion(url: str, prompt: list[int], choice: dict) -> tuple[list[int], list[float], str, Optional[str]]:
    """A choice answering `completion_request(prompt, ...)` as `(token ids, their logprobs, text,
    the stop string it ended at or None)`; `ServerError` naming `url` when a part is missing."""
    tokens = choice.get("token_ids")
    logprobs = (choice.get("logprobs") or {}).get("token_logprobs")
    if tokens is None or logprobs is None or len(tokens) != len(logprobs) or any(lp is None for lp in logprobs):
        raise ServerError(
            f"vLLM server {url} answered without the token ids and logprobs of its completion "
            "(a vLLM without `return_token_ids`?)"
        )
    served_prompt = choice.get("prompt_token_ids")
    if served_prompt is not None and list(served_prompt) != prompt:
        raise ServerError(f"vLLM server {url} sampled from other prompt tokens than were sent")
    stop_reason = choice.get("stop_reason")
    stop_reason = stop_reason if isinstance(stop_reason, str) else None  # an int would be a stop token id
    return list(tokens), list(logprobs), choice.get("text") or "", stop_reason


@dataclass
class PartialChoice:
    """One completion as its streamed chunks build it: the tokens so far, their logprobs and the
    weight version of each, across every request that generated a part of it."""

    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""
    """The server's text of the request that generated all of it (only read when no sync interrupted it)."""
    finish_reason: Optional[str] = None
    """None while the completion may still grow."""
    stop_reason: Optional[str] = None
    requests: int = 0
    """How many requests generated a part of it (1: never interrupted)."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def whole_text(self) -> Optional[str]:
        """The server's text, when one request generated all of it (None: it came in parts)."""
        return self.text if self.requests == 1 else None


def read_chunk(url: str, chunk: dict, choices: list[PartialChoice], version: int, prompt: list[int]) -> None:
    """Add one streamed `/v1/completions` chunk to `choices` (indexed by the chunk's choice
    index), its tokens tagged with `version`. `ServerError` naming `url` for an error chunk or a
    chunk without the token ids and logprobs of its tokens."""
    if "error" in chunk:
        raise ServerError(f"vLLM server {url} failed a streamed completion: {str(chunk['error'])[:500]}")
    for part in chunk.get("choices") or []:
        index = int(part.get("index", 0))
        if not 0 <= index < len(choices):
            raise ServerError(f"vLLM server {url} streamed choice {index} of a request for {len(choices)}")
        served_prompt = part.get("prompt_token_ids")
        if served_prompt is not None and list(served_prompt) != prompt:
            raise ServerError(f"vLLM server {url} sampled from other prompt tokens than were sent")
        tokens = list(part.get("token_ids") or [])
        logprobs = list((part.get("logprobs") or {}).get("token_logprobs") or [])
        if len(tokens) != len(logprobs) or any(lp is None for lp in logprobs):
            raise ServerError(
                f"vLLM server {url} streamed {len(tokens)} token ids with {len(logprobs)} logprobs "
                "(a vLLM without `return_token_ids` in streams?)"
            )
        c = choices[index]
        c.tokens += tokens
        c.logprobs += [float(lp) for lp in logprobs]
        c.versions += [version] * len(tokens)
        c.text += part.get("text") or ""
        if part.get("finish_reason") is not None:
            c.finish_reason = str(part["finish_reason"])
            reason = part.get("stop_reason")
            c.stop_reason = reason if isinstance(reason, str) else None  # an int would be a stop token id


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
