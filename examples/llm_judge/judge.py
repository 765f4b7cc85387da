"""An LLM judge as an async reward: each completion is sent to an OpenAI-compatible server (a
second vLLM server, `vllm serve`, or any hosted endpoint), which answers with a grade.

    reward.fn=judge:judge_reward                      # from this folder, the judge alone
    reward.fn=[arithmetic,judge:judge_reward] reward.weights=[1.0,0.2]

The server is `LIT_GRPO_JUDGE_URL` (default http://127.0.0.1:8100) and its model
`LIT_GRPO_JUDGE_MODEL` (default: the first one it lists at /v1/models). Being `async def`, the
reward runs concurrently with the other samples' rewards, at most `reward.max_concurrency` requests
in flight, each under `reward.timeout_s` (past it, `reward.timeout_reward` and a count in
`reward/timed_out`). Needs httpx (`pip install lit_grpo[server]`).
"""

from __future__ import annotations

import os
import re

try:
    import httpx
except ImportError as err:  # the example's one dependency beyond lit_grpo
    raise ImportError("the judge example needs httpx: pip install 'lit_grpo[server]'") from err

JUDGE_PROMPT = "Question: {question}\nAnswer: {answer}\nGrade the answer from 0 (wrong) to 9 (right). Grade: "
_models: dict[str, str] = {}


def judge_url() -> str:
    return os.environ.get("LIT_GRPO_JUDGE_URL", "http://127.0.0.1:8100").rstrip("/")


async def judge_model(client: httpx.AsyncClient, url: str) -> str:
    """The model to ask: `LIT_GRPO_JUDGE_MODEL`, else the server's first (asked once per server)."""
    if name := os.environ.get("LIT_GRPO_JUDGE_MODEL"):
        return name
    if url not in _models:
        response = await client.get(f"{url}/v1/models")
        response.raise_for_status()
        _models[url] = response.json()["data"][0]["id"]
    return _models[url]


def grade(text: str) -> float:
    """The first digit of the judge's reply, scaled to [0, 1]; 0 when there is none."""
    match = re.search(r"\d", text)
    return int(match.group()) / 9 if match else 0.0


async def judge_reward(completion_text: str, row: dict) -> float:
    """The judge's grade of `completion_text` as an answer to the row's prompt, in [0, 1]."""
    url = judge_url()
    # The scorer's deadline bounds the call; a judge on this machine is reached without a proxy.
    local = httpx.URL(url).host in ("127.0.0.1", "localhost", "::1")
    async with httpx.AsyncClient(timeout=None, trust_env=not local) as client:
        request = {
            "model": await judge_model(client, url),
            "prompt": JUDGE_PROMPT.format(question=row.get("prompt", ""), answer=completion_text.strip()),
            "max_tokens": 2,
            "temperature": 0.0,
        }
        response = await client.post(f"{url}/v1/completions", json=request)
        response.raise_for_status()
        return grade(response.json()["choices"][0]["text"])
