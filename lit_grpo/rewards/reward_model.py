"""A reward model as a reward: a sequence classifier scoring (prompt, completion), in the trainer's process.

`reward.model` names it (a folder or a hub name); it is the component `reward_model` of `reward.fn`
and scores like any `async def` reward (same deadline, concurrency limit and weight). It is loaded
with `AutoModelForSequenceClassification` and its own tokenizer, put in eval mode with no
gradients on `reward.model_device` in `reward.model_dtype`, and held by the reward alone: never
in the policy's module, its optimizer or its checkpoints.

The input is the reward model's own formatting of the conversation: the row's prompt (text
becomes one user message; chat messages are kept, minus assistant turns at their end) followed by
the completion as an assistant message, through the tokenizer's chat template when it has one;
without a template, the prompt's text (chat messages' contents joined by newlines) followed
directly by the completion, tokenized with the tokenizer's special tokens. A prompt of token ids
cannot be read by another tokenizer and is refused (`RewardRowError`).

The score is the model's one logit (`num_labels=1`); a model with more labels, or whose score
head was not in its weights (a causal LM loaded as a classifier gets a random one; its config
says num_labels=2, so the missing head is named first), is refused when it loads. Concurrent
requests are gathered into one forward (`ModelBatcher`: up to `reward.model_batch_size`, waiting
`reward.model_linger_s` for more), run on a thread so the rollouts' event loop never waits on it.
Padding is on the right, with the model's pad token, so that a batch scores as each sequence
would alone (the model reads its last non-pad token); a model without a pad token
(`config.pad_token_id`) scores one sequence per forward.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, Optional

from lit_grpo.config import ConfigError
from lit_grpo.rewards.registry import RewardRowError
from lit_grpo.rewards.scoring import in_daemon_thread

Prompt = Any
"""A row's prompt as stored: text, or a list of chat messages."""


def conversation(prompt: Prompt, completion: str) -> list[dict]:
    """The chat messages the reward model reads: the prompt (text: one user message; messages:
    minus assistant turns at their end) and the completion as the assistant's reply."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        messages = list(prompt)
        while messages and messages[-1].get("role") == "assistant":
            messages.pop()
    else:
        raise RewardRowError(
            f"reward 'reward_model': the row's prompt is {type(prompt).__name__} {repr(prompt)[:60]}; the reward "
            "model reads text or chat messages (its own tokenizer formats them), not token ids: give the rows "
            "a `prompt` or `messages` field (data.prompt_field)"
        )
    return [*messages, {"role": "assistant", "content": completion}]


def input_ids(tokenizer, prompt: Prompt, completion: str) -> list[int]:
    """The token ids the reward model scores for (prompt, completion) (see the module docstring)."""
    messages = conversation(prompt, completion)
    if getattr(tokenizer, "chat_template", None):
        # The template writes the special tokens itself (a BOS among them): none are added twice.
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    text = "\n".join(str(m.get("content", "")) for m in messages[:-1]) + completion
    return list(tokenizer(text)["input_ids"])


def forward_scores(model, ids: Sequence[Sequence[int]]) -> list[float]:
    """The model's logit for each token-id sequence, in order: one forward, right-padded with the
    model's pad token (without one, a forward per sequence).
    Shape: ids is B sequences; the result B floats."""
    import torch

    pad_id = model.config.pad_token_id
    # transformers refuses a batch of several sequences without a pad token, even of one length
    groups = [list(range(len(ids)))] if pad_id is not None else [[i] for i in range(len(ids))]
    scores: list[float] = [0.0] * len(ids)
    device = next(model.parameters()).device
    for group in groups:
        longest = max(len(ids[i]) for i in group)
        tokens_BT = torch.full((len(group), longest), pad_id if pad_id is not None else 0, dtype=torch.long)
        mask_BT = torch.zeros((len(group), longest), dtype=torch.long)
        for row, i in enumerate(group):
            tokens_BT[row, : len(ids[i])] = torch.tensor(ids[i], dtype=torch.long)
            mask_BT[row, : len(ids[i])] = 1
        with torch.no_grad():
            logits = model(input_ids=tokens_BT.to(device), attention_mask=mask_BT.to(device)).logits
        for row, i in enumerate(group):
            scores[i] = float(logits[row, 0].float())
    return scores


def model_device(setting: str) -> str:
    """`reward.model_device` as a torch device: `auto` is this rank's GPU (LOCAL_RANK), else the CPU."""
    if setting != "auto":
        return setting
    import os

    import torch

    return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"


def unreachable(name: str, err: Exception) -> Exception:
    """A `ModelLoadError` naming `reward.model` and the fix."""
    from lit_grpo.models.load import ModelLoadError

    return ModelLoadError(
        f"Could not load the reward model reward.model={name!r}: {type(err).__name__}: {str(err)[:400]}\n"
        "If this machine cannot reach the Hugging Face hub, download it elsewhere and point at the local "
        "copy with `reward.model=/path/to/model` (set HF_HUB_OFFLINE=1 to fail fast)."
    )


def load_reward_tokenizer(name: str):
    """The reward model's own tokenizer (it formats the reward model's input); `ModelLoadError` naming
    `reward.model` when it cannot be loaded."""
    from transformers import AutoTokenizer

    from lit_grpo.config.sources import model_path_problem
    from lit_grpo.models.load import ModelLoadError

    if why := model_path_problem(name, field="reward.model"):
        raise ModelLoadError(f"reward.model={name}: {why}")
    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as err:
        raise unreachable(name, err) from None


def load_reward_model(name: str, device: str = "cpu", dtype: str = "float32"):
    """The reward model `name` and its tokenizer, ready to score: eval mode, no gradients, on
    `device` in `dtype`. `ModelLoadError` naming `reward.model` when it cannot be loaded; `ConfigError`
    when it is no reward model (more than one label, or no score head in its weights)."""
    from transformers import AutoModelForSequenceClassification

    from lit_grpo.models.load import DTYPES

    tokenizer = load_reward_tokenizer(name)
    try:
        model, info = AutoModelForSequenceClassification.from_pretrained(
            name, dtype=DTYPES[dtype], output_loading_info=True
        )
    except (OSError, ValueError) as err:
        raise unreachable(name, err) from None
    head = [k for k in info.get("missing_keys", ()) if not k.startswith(model.base_model_prefix + ".")]
    if head:
        raise ConfigError(
            f"config field `reward.model`: {name} has no trained score head (missing from its weights: "
            f"{', '.join(sorted(head))}), so it would score with random weights; is it a causal LM rather "
            "than a reward model?"
        )
    if model.config.num_labels != 1:
        raise ConfigError(
            f"config field `reward.model`: {name} has num_labels={model.config.num_labels}; a reward model "
            "scores with one logit (num_labels=1). Wrap a classifier of several labels in a reward function of "
            "your own (reward.fn=my_module:my_reward) to choose how its labels make a reward"
        )
    return model.to(model_device(device)).eval().requires_grad_(False), tokenizer


class ModelBatcher:
    """Gathers the requests of one event loop into batches for `run_batch(items) -> scores`,
    run on a thread: a batch goes when it holds `batch_size` items or `linger_s` after its first,
    one batch at a time (requests made while one runs go as soon as it ends). A request whose
    caller gave up (its deadline) is left out if its batch has not started."""

    def __init__(self, run_batch: Callable[[list], list[float]], batch_size: int, linger_s: float) -> None:
        self.run_batch, self.batch_size, self.linger_s = run_batch, batch_size, linger_s
        self.pending: list[tuple[Any, asyncio.Future]] = []
        self.timer: Optional[asyncio.TimerHandle] = None
        self.running = False
        self.tasks: set[asyncio.Task] = set()  # a task nobody references may be collected mid-batch

    async def submit(self, item: Any) -> float:
        """`item`'s score, from the batch it joins."""
        future = asyncio.get_running_loop().create_future()
        self.pending.append((item, future))
        self._schedule()
        return await future

    def _schedule(self) -> None:
        if self.running or not self.pending:
            return  # the running batch schedules the next one when it ends
        if len(self.pending) >= self.batch_size:
            self._start()
        elif self.timer is None:
            self.timer = asyncio.get_running_loop().call_later(self.linger_s, self._start)

    def _start(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        taken, self.pending = self.pending[: self.batch_size], self.pending[self.batch_size :]
        taken = [(item, future) for item, future in taken if not future.done()]  # callers past their deadline
        if not taken:
            self._schedule()
            return
        self.running = True
        task = asyncio.get_running_loop().create_task(self._run(taken))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _run(self, taken: list[tuple[Any, asyncio.Future]]) -> None:
        try:
            scores = await in_daemon_thread(self.run_batch, [item for item, _ in taken])
        except Exception as err:  # every caller of the batch gets it: the forward failed
            for _, future in taken:
                if not future.done():
                    future.set_exception(err)
        else:
            for (_, future), score in zip(taken, scores):
                if not future.done():
                    future.set_result(score)
        finally:
            self.running = False
            if self.pending:  # they have waited for this batch already: no linger
                self._start()


class RewardModelReward:
    """The component `reward_model`: `await reward(completion_text, row) -> float`, the reward model's
    score of the row's prompt (`prompt_of(row)`) and the completion, batched with concurrent calls.
    `forward(token_ids) -> scores` scores a batch: the model here (`forward_scores`) or its server
    (`lit_grpo.rewards.reward_server.ServedScores`)."""

    def __init__(
        self,
        tokenizer,
        forward: Callable[[list[list[int]]], list[float]],
        *,
        prompt_of: Callable[[dict], Prompt],
        batch_size: int = 32,
        linger_s: float = 0.01,
        name: str = "reward model",
        model: Any = None,
    ) -> None:
        self.tokenizer, self.forward, self.prompt_of, self.name = tokenizer, forward, prompt_of, name
        self.model = model
        """The model scoring here (None when it is served)."""
        self.batch_size, self.linger_s = batch_size, linger_s
        self._lock = threading.Lock()  # one forward at a time, whichever event loop asks (rollouts, evaluation)
        self._batchers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self.batches = 0
        """Batches scored (`score_pairs` calls)."""

    def score_pairs(self, pairs: Sequence[tuple[Prompt, str]]) -> list[float]:
        """The scores of (prompt, completion) pairs, in one batch, on the calling thread."""
        with self._lock:  # the tokenizer too: a Rust tokenizer shared by threads may refuse ("Already borrowed")
            ids = [input_ids(self.tokenizer, prompt, completion) for prompt, completion in pairs]
            self.batches += 1
            return self.forward(ids)

    def _batcher(self) -> ModelBatcher:
        loop = asyncio.get_running_loop()  # futures and timers belong to one loop: a batcher per loop
        if loop not in self._batchers:
            self._batchers[loop] = ModelBatcher(self.score_pairs, self.batch_size, self.linger_s)
        return self._batchers[loop]

    async def __call__(self, completion_text: str, row: dict) -> float:
        prompt = self.prompt_of(row)
        conversation(prompt, completion_text)  # a prompt it cannot read fails this row, not the batch
        return await self._batcher().submit((prompt, completion_text))

    def __repr__(self) -> str:
        return f"RewardModelReward({self.name})"


def default_prompt(row: dict) -> Prompt:
    """The row's `messages`, else its `prompt` (what the default rollout reads when `data.prompt_field` is null)."""
    for field in ("prompt_token_ids", "messages", "prompt"):
        if isinstance(row, dict) and row.get(field) is not None:
            return row[field]
    raise RewardRowError(
        f"reward 'reward_model': the row has no prompt field (prompt or messages); its fields: "
        f"{', '.join(map(str, row)) if isinstance(row, dict) else type(row).__name__}"
    )


def reward_model_reward(cfg, prompt_of: Optional[Callable[[dict], Prompt]] = None) -> RewardModelReward:
    """The component `reward_model` of `cfg` (`RewardConfig`): `reward.model` loaded here, or only its
    tokenizer when `reward.model_url` serves it, batched as `reward.model_batch_size` and
    `reward.model_linger_s` say."""
    common = dict(prompt_of=prompt_of or default_prompt, batch_size=cfg.model_batch_size, linger_s=cfg.model_linger_s)
    if cfg.model_url is not None:
        from lit_grpo.rewards.reward_server import ServedScores

        served = ServedScores(cfg.model_url, cfg.model_api_key_env, cfg.model_request_timeout_s)
        return RewardModelReward(
            load_reward_tokenizer(cfg.model), served, name=f"{cfg.model} at {cfg.model_url}", **common
        )
    model, tokenizer = load_reward_model(cfg.model, cfg.model_device, cfg.model_dtype)
    return RewardModelReward(tokenizer, functools.partial(forward_scores, model), name=cfg.model, model=model, **common)
