"""A served reward model: `reward.model_url`, a vLLM server of the reward model's pooling runner.

    python -m lit_grpo.serve --model RM_FOLDER --port 8001 --runner pooling --convert classify

The trainer formats each (prompt, completion) with the reward model's own tokenizer, as in process
(`lit_grpo.rewards.reward_model.input_ids`), and sends a batch's token ids to the server's
`/classify` with `use_activation: false`: the answer is the raw logit, the score the model gives in
process. Measured on vLLM 0.32's CPU build with a tiny Qwen2ForSequenceClassification: the same
logits as transformers' forward to 1e-5.

A call runs on the batch's own thread (`ModelBatcher`), with the key from the environment variable
`reward.model_api_key_env` names (the server's key: `python -m lit_grpo.serve` with `LIT_GRPO_SERVER_KEY`
or `--api-key-file`; every route but /health then needs it). Failures, by kind:

- unreachable, reset, 5xx, 429 or no answer within `reward.model_request_timeout_s`: a
  `ServerUnreachable` (a `ConnectionError`) naming the server, which the rollout retries like any
  transient reward error (`guards.rollout_retry_on`, `guards.rollout_max_retries`), the whole under
  `reward.timeout_s`; when rows keep failing on it, the rollouts' circuit breaker stops the run
  with a `ServerLost` that says to start the server again and where `resume=auto` continues;
- 401 (no key or another one) or any other answer it cannot use: `RewardServerError`, which stops
  the run at once naming the server: it would fail every sample the same way.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request

from lit_grpo.errors import EnvironmentFault, ServerUnreachable


class RewardServerError(EnvironmentFault):
    """The reward model's server refused the key or answered something unusable: the run stops."""

    remedy = "Fix reward.model_url or the server's key (reward.model_api_key_env)"


class ServedScores:
    """`forward(token_ids) -> scores` of a batch, from the reward model's server at `url`."""

    def __init__(self, url: str, api_key_env: str, timeout_s: float) -> None:
        self.url, self.api_key_env, self.timeout_s = url.rstrip("/"), api_key_env, timeout_s

    def __call__(self, ids: list[list[int]]) -> list[float]:
        body = json.dumps({"input": [list(x) for x in ids], "use_activation": False}).encode()
        headers = {"Content-Type": "application/json"}
        if key := os.environ.get(self.api_key_env):
            headers["Authorization"] = f"Bearer {key}"
        request = urllib.request.Request(f"{self.url}/classify", data=body, headers=headers, method="POST")
        where = f"reward model server {self.url} (reward.model_url)"
        remedy = f"Start the reward model server again at {self.url} (or point reward.model_url at a live one)"
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")[:300]
            if err.code >= 500 or err.code == 429:
                raise ServerUnreachable(f"{where} answered {err.code}: {detail}", remedy=remedy) from None
            if err.code == 401:
                raise RewardServerError(
                    f"{where} answered 401: it needs its key, and lit_grpo sent none or another one (read from "
                    f"the environment variable reward.model_api_key_env names, {self.api_key_env})"
                ) from None
            raise RewardServerError(f"{where}: /classify answered {err.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, OSError) as err:  # refused, reset, no answer in time
            reason = getattr(err, "reason", err)
            raise ServerUnreachable(
                f"{where}: /classify failed ({type(reason).__name__}: {reason})", remedy=remedy
            ) from None
        return scores_of(answer, len(ids), where)


def scores_of(answer: object, count: int, where: str) -> list[float]:
    """The `count` logits of a `/classify` answer, in input order; `RewardServerError` when it holds
    anything else (another number of rows, or a model of several labels)."""
    try:
        rows = sorted(answer["data"], key=lambda d: d["index"])  # type: ignore[index]
        values = [row["probs"] for row in rows]
    except (KeyError, TypeError) as err:
        raise RewardServerError(f"{where}: /classify answered no scores ({err!r}): {str(answer)[:200]}") from None
    if len(values) != count or any(len(v) != 1 for v in values):
        raise RewardServerError(
            f"{where}: /classify answered {len(values)} rows of {sorted({len(v) for v in values})} values for "
            f"{count} inputs; a reward model gives one value each (num_labels=1)"
        )
    return [float(v[0]) for v in values]
