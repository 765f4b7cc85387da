"""The transformers sampler: batched `generate` with a KV cache, on a copy of the policy's weights
or, where sampling never overlaps training, on the policy itself (`share_weights`).

Logprobs are those of the sampling distribution: `log_softmax(logits / temperature)` with
top_p=1 and top_k=0, so they can serve as the behaviour policy in TIS; `inference_logprobs` are
the raw `log_softmax(logits)`. Each token is drawn from that distribution by `draw_tokens` (an
inverted cumulative sum: exact, and a fraction of `torch.multinomial`'s cost at a wide vocabulary),
handed to generate as a one-token distribution its greedy step takes. Stop strings are cut after
generation (`stops.find_stop`); a stopping criterion only ends the rows that completed one early,
so a batch whose rows all stopped returns before `max_tokens`.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import re
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Optional

import torch
from transformers import (
    GenerationConfig,
    LogitsProcessor,
    LogitsProcessorList,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    StoppingCriteria,
    StoppingCriteriaList,
)

from lit_grpo.maths.logprobs import token_logprobs
from lit_grpo.maths.multimodal import vision_forward_kwargs
from lit_grpo.maths.onednn_linear import onednn_linears
from lit_grpo.models.weights import DTensor
from lit_grpo.samplers.arguments import SamplerTimeout
from lit_grpo.samplers.base import BatchingSampler, normalize_weight_name, strip_wrapper_prefixes
from lit_grpo.samplers.shared_prefill import shared_prompt_cache
from lit_grpo.samplers.stops import find_stop, first_stop
from lit_grpo.types import Completion, MultiModalBatch

_ADAPTER_SEGMENT = re.compile(r"\.(lora_[AB])\.[^.]+\.(?=weight$)")
"""The adapter's name in a peft model's state-dict name (`q_proj.lora_A.default.weight`), which
peft's saved names (`q_proj.lora_A.weight`) leave out."""


class HFSampler(BatchingSampler):
    """Implements the `Sampler` protocol with `model.generate`, on a private copy of the policy or,
    with `share_weights`, on the policy itself.

    Shared weights are for synchronous training with a sync after every step (what
    `TrainConfig.sampler_shares_policy_weights` decides): the trainer's updates are what the next
    sample sees, so a weight sync copies nothing; the sampler never moves or casts the model (eval
    mode is the trainer's too), and turns its `requires_grad` flags off only for the length of a
    call (`_as_a_copy`); generation builds no graph (inference mode). Between a step's rollouts and
    its sync the trainer holds the weights (`sleep`), so no generate call reads them while they change.

    A vision-language policy's prompts come with their images (`multi_modal`, `takes_images`):
    generate gets them as its forward does (`lit_grpo.maths.multimodal`), left-padded rows and all.

    A LoRA policy's copy is a copy of the peft model, adapters and all, when the sync sends the
    adapter alone (`update_adapter`): only the adapter tensors are copied at a sync, and generation
    computes exactly as the trainer does (base and adapters unmerged). With merged syncs the copy is
    of the base model, and every weight is copied.
    """

    takes_images = True

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer: PreTrainedTokenizerBase,
        *,
        max_batch_size: int = 256,
        share_weights: bool = False,
        share_prompt_prefill: bool = True,
        onednn_linear: Optional[bool] = None,
    ) -> None:
        super().__init__(tokenizer, max_batch_size=max_batch_size)
        self.shares_weights = share_weights
        self.share_prompt_prefill = share_prompt_prefill
        """Encode each distinct prompt of a batch once (`lit_grpo.samplers.shared_prefill`): a group's
        G completions share their prompt's prefill."""
        self.onednn_linear = onednn_linear
        """On a CPU, a float32 model's linear layers compute through oneDNN while it generates
        (`lit_grpo.maths.onednn_linear`); None: with two or more torch threads, where it measured
        faster than MKL at a decode step's few rows (`make bench-decode`: 305 ms against 361 a
        SmolLM2 step of 32 rows at 2 threads; at 1 thread 539 against 484, so MKL there)."""
        self.prefill_tokens_saved = 0
        """Prompt tokens the shared prefill did not encode, over this sampler's life."""
        self.version = 0
        """Weight syncs loaded, unless set (the run's policy version: `enable_partial_rollouts`)."""
        self.last_sync_bytes = 0
        """What the last weight sync copied into a private copy (shared weights: nothing)."""
        self.partial_rollouts = False
        if share_weights:
            self.model = model.eval()  # GRPOModule keeps its policy in eval mode too (no dropout)
            # Re-entrant: a generate call on the thread that holds the weights for training (a callback
            # between the step and its sync) runs, sequential with training; one on another thread waits.
            self._weights_lock = threading.RLock()
            self._held_for_training_by: Optional[int] = None
            """The thread holding the weights between a step's rollouts and its sync (None: not held)."""
            return
        self.model = copy.deepcopy(model).eval().requires_grad_(False)
        # The model's own tensors by state-dict name (tied weights under every name, as engines such
        # as vLLM list them): a sync copies into them, so they are looked up once, not every sync.
        self._state = self.model.state_dict()
        self._aliases = _tied_aliases(self._state)
        self._plan: Optional[tuple[list[str], list[torch.Tensor]]] = None
        """The names of the last sync and the tensors they copy into: looked up once, not every sync."""
        self._adapter_plan: Optional[tuple[list[str], list[torch.Tensor]]] = None
        """The same for the adapter syncs (`update_adapter`)."""

    def to_device(self, device: torch.device) -> None:
        """Generate on `device` (the trainer's: the policy was on the CPU when this copy was made).
        Shared weights are the trainer's to move: generation follows them wherever they are."""
        if self.shares_weights:
            return
        with self._weights_lock:
            self.model.to(device)
            self._state = self.model.state_dict()
            self._plan = self._adapter_plan = None

    def sleep(self) -> None:
        """Shared weights: once a step's rollouts are in, hold the weights until the step's sync
        (`update_weights`), so the optimizer never changes what a generate call reads. A call still
        running (one that outlived its rollout's deadline on the worker thread) ends first, within
        `call_timeout_s`; a call from another thread waits for the sync. A private copy: nothing to do."""
        if not self.shares_weights or self._held_for_training_by is not None:
            return
        if not self._weights_lock.acquire(timeout=-1 if self.call_timeout_s is None else self.call_timeout_s):
            raise SamplerTimeout(
                f"the training step waited {self.call_timeout_s:g} s (guards.rollout_timeout_s) for the sampler's "
                "running generate call to end: the engine looks stuck"
            )
        self._held_for_training_by = threading.get_ident()

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the policy's weights; with shared weights, consume them (copying nothing: the sampler
        already generates with them) and let generation go on."""
        try:
            super().update_weights(named_tensors)
            self.version += 1
        finally:
            self._release_weights()

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: Any, version=None) -> None:
        """A LoRA policy's adapter alone (`sampler.lora_sync=adapter`; peft-saved names, as
        `lit_grpo.models.lora.adapter_tensors` gives them, and its peft config) as policy `version`
        (default: the next). Shared weights: consumed, copying nothing (the sampler generates with
        the adapters being trained). A copy: copied into the copy's own adapters, its base weights
        untouched (they never change in LoRA training); it must have been made from the LoRA policy."""
        try:
            self._between_calls(self._load_adapter, named_tensors)
            self.version = self.version + 1 if version is None else int(version)
        finally:
            self._release_weights()

    def enable_partial_rollouts(self) -> None:
        """Tag every generated token with the version of the weights it came from. A generate call
        is never interrupted (a sync waits for it), so a completion's tokens share one version; the
        turns of a multi-turn rollout carry each its own."""
        self.partial_rollouts = True

    def close(self) -> None:
        self._release_weights()  # a step that failed before its sync: queued calls end instead of waiting
        super().close()

    def _release_weights(self) -> None:
        if self.shares_weights and self._held_for_training_by == threading.get_ident():
            self._held_for_training_by = None
            self._weights_lock.release()

    def _device(self) -> torch.device:
        """Where the model is; shared weights must be whole (a sharded policy needs a copy of its own)."""
        first = next(self.model.parameters())
        if self.shares_weights and (isinstance(first, DTensor) or getattr(first, "_fsdp_flattened", False)):
            raise RuntimeError(
                "the sampler generates with the policy itself, but the trainer's strategy sharded it: "
                "set sampler.share_policy_weights=false"
            )
        return first.device

    @contextlib.contextmanager
    def _as_a_copy(self) -> Iterator[None]:
        """Shared weights compute as a private copy (`requires_grad=False`) does, bit for bit: ATen's
        matmul folds a 3-D input into one mm when an operand requires grad, even in inference mode,
        and rounds differently from the batched path it takes otherwise (generate's last-position
        hidden state is such an input). The trainer's flags come back when the call ends; no
        training step runs meanwhile (see `sleep`)."""
        trainable = [p for p in self.model.parameters() if p.requires_grad] if self.shares_weights else []
        for p in trainable:
            p.requires_grad_(False)
        try:
            yield
        finally:
            for p in trainable:
                p.requires_grad_(True)

    @torch.no_grad()
    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.shares_weights:
            # The caller's contract (`lit_grpo.models.weights`): every tensor is consumed, to the end.
            collections.deque(named_tensors, maxlen=0)
            return
        names, tensors = [], []
        for name, tensor in named_tensors:
            names.append(name)
            tensors.append(tensor)
        if self._plan is None or self._plan[0] != names:  # the first sync, or another set of names
            self._plan = (names, self._targets(names))
        self.last_sync_bytes = sum(t.numel() * t.element_size() for t in tensors)
        # One kernel over every tensor; copy_ semantics, so it casts the dtype and moves the device.
        torch._foreach_copy_(self._plan[1], tensors)

    @torch.no_grad()
    def _load_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.shares_weights:
            collections.deque(named_tensors, maxlen=0)  # every tensor consumed, as `_load`
            return
        names, tensors = [], []
        for name, tensor in named_tensors:
            names.append(name)
            tensors.append(tensor)
        if self._adapter_plan is None or self._adapter_plan[0] != names:
            self._adapter_plan = (names, self._adapter_targets(names))
        self.last_sync_bytes = sum(t.numel() * t.element_size() for t in tensors)
        torch._foreach_copy_(self._adapter_plan[1], tensors)

    def _adapter_targets(self, names: list[str]) -> list[torch.Tensor]:
        """The copy's adapter tensor each peft-saved name is copied into; refuses a sync that would
        leave one of them stale (a copy made of the policy before its adapters were added has none)."""
        own = {_ADAPTER_SEGMENT.sub(r".\1.", name): name for name in self._state if _ADAPTER_SEGMENT.search(name)}
        keys = [own.get(strip_wrapper_prefixes(name)) for name in names]
        unknown = [name for name, key in zip(names, keys) if key is None]
        if unknown or not own:
            raise RuntimeError(
                f"adapter sync: {len(unknown)} adapter tensors have no counterpart in the sampler's copy, e.g. "
                f"{unknown[:3]} (the copy holds {len(own)} adapter tensors: was it made of the LoRA policy?)"
            )
        stale = set(own.values()) - set(keys)
        if stale:
            raise RuntimeError(
                f"adapter sync left {len(stale)} sampler adapter tensors stale, e.g. {sorted(stale)[:3]}"
            )
        return [self._state[key] for key in keys]  # None refused above

    def _targets(self, names: list[str]) -> list[torch.Tensor]:
        """The sampler's tensor each of `names` is copied into; refuses names that would leave one stale."""
        state = self._state
        keys = [normalize_weight_name(name, state) for name in names]
        missing = set(state) - set(keys) - {alias for key in keys for alias in self._aliases.get(key, ())}
        if missing:
            raise RuntimeError(f"weight sync left {len(missing)} sampler weights stale, e.g. {sorted(missing)[:3]}")
        return [state[key] for key in keys]

    @torch.inference_mode()
    def _generate(
        self,
        prompts: list[list[int]],
        temperature: float,
        max_tokens: int,
        stop: tuple[str, ...] = (),
        multi_modal: Optional[list[Optional[dict[str, torch.Tensor]]]] = None,
    ) -> list[Completion]:
        device = self._device()
        pad_id, eos_id = self.tokenizer.pad_token_id, self.eos_token_id
        width = max(len(p) for p in prompts)
        input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        attention = torch.zeros((len(prompts), width), dtype=torch.long)
        for i, p in enumerate(prompts):
            input_ids[i, width - len(p) :] = torch.tensor(p)
            attention[i, width - len(p) :] = 1
        # Temperature 0 is greedy decoding (evaluation); its logprobs are reported at temperature 1.
        # Above 0 each step's token is drawn by `_DrawByInverseCdf` (exact, and cheaper than generate's
        # own draw), which hands generate's greedy step a distribution with all its mass on that token.
        drawn = [_DrawByInverseCdf(temperature)] if temperature > 0 else []
        gen_config = GenerationConfig(
            do_sample=False,
            # generate fills what is unset here from the model's own generation config: a released
            # model's repetition penalty would change the scores before the recorder sees them.
            repetition_penalty=1.0,
            max_new_tokens=max_tokens,
            eos_token_id=eos_id,
            pad_token_id=pad_id,
            return_dict_in_generate=True,
        )
        temperature = temperature or 1.0
        ends = _StopStrings(self.tokenizer, stop, width) if stop else None
        recorder = _LogprobRecorder(temperature)
        images = MultiModalBatch.of(multi_modal) if multi_modal is not None else None
        vision = (
            {}
            if images is None
            else {k: v.to(device) for k, v in vision_forward_kwargs(self.model, input_ids, images.tensors).items()}
        )
        onednn = self.onednn_linear if self.onednn_linear is not None else torch.get_num_threads() >= 2
        fast_linears = onednn_linears(self.model) if onednn else contextlib.nullcontext()
        with self._as_a_copy(), _contiguous_head_input(self.model), fast_linears:
            shared = (
                shared_prompt_cache(self.model, input_ids.to(device), attention.to(device))
                if self.share_prompt_prefill and images is None and not _reads_images(self.model)
                else None
            )
            cache = None
            if shared is not None:
                cache, saved = shared
                self.prefill_tokens_saved += saved
            out = self.model.generate(
                input_ids=input_ids.to(device),
                attention_mask=attention.to(device),
                **({"past_key_values": cache} if cache is not None else {}),
                **vision,
                generation_config=gen_config,
                logits_processor=LogitsProcessorList([recorder, *drawn]),
                stopping_criteria=StoppingCriteriaList([_UntilCancelled(self.cancelled), *([ends] if ends else [])]),
            )
        new_tokens_NS = out.sequences[:, width:].cpu()
        sampling_NS, raw_NS = recorder.finish(out.sequences[:, -1])
        cut = []
        for i, row in enumerate(new_tokens_NS.tolist()):
            row = row[: ends.ended.get(i, len(row))] if ends else row  # after its stop: padding, never sampled
            cut.append(row[: row.index(eos_id) + 1] if eos_id in row else row)
        texts = self.tokenizer.batch_decode(cut, skip_special_tokens=True)
        completions = []
        for p, row, lp, raw, text in zip(prompts, cut, sampling_NS.tolist(), raw_NS.tolist(), texts):
            match = find_stop(row, stop, self._decode, text) if stop else None
            if match is not None:
                row, text = row[: match.num_tokens], match.text
            versions = [self.version] * len(row) if self.partial_rollouts else None  # generate holds the weights
            stop_reason = match.stop if match else None
            completions.append(
                self.completion(
                    p, row, lp, text, inference_logprobs=raw, stop_reason=stop_reason, token_versions=versions
                )
            )
        return completions

    def _decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    @torch.inference_mode()
    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """One forward over the right-padded prompt + target rows through the trainer's own
        `token_logprobs` (temperature 1), packed into one row where the model allows it (no padding
        computed): entry j - 1 scores token j."""
        device = self._device()
        rows = [p + t for p, t in pairs]
        width = max(map(len, rows))
        input_ids = torch.full((len(rows), width), self.tokenizer.pad_token_id, dtype=torch.long)
        attention = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            input_ids[i, : len(row)] = torch.tensor(row)
            attention[i, : len(row)] = 1
        with self._as_a_copy():
            logprobs_BT, _ = token_logprobs(
                self.model, input_ids.to(device), attention.to(device), 1.0, padding_free=True
            )
        return [
            logprobs_BT[i, len(prompt) - 1 : len(prompt) + len(target) - 1].tolist()
            for i, (prompt, target) in enumerate(pairs)
        ]


@contextlib.contextmanager
def _contiguous_head_input(model: PreTrainedModel) -> Iterator[None]:
    """The LM head gets a contiguous input for the length of a generate call. The prefill hands it
    the last position of every row, `hidden[:, -1:, :]` [N, 1, H], a strided view; with no operand
    requiring grad (a private copy, or shared weights under `_as_a_copy`) ATen's matmul runs that
    as a bmm over the N rows, reading the whole [V, H] head N times (0.5 s a call at 16 rows of
    151,936 ids on a CPU), where a contiguous [N, 1, H] folds into one mm. Copying N × H floats
    is nothing beside it. Models without an output embedding are left as they are."""
    head = model.get_output_embeddings()
    handle = head.register_forward_pre_hook(_contiguous_first_input) if isinstance(head, torch.nn.Module) else None
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def _reads_images(model: PreTrainedModel) -> bool:
    """A vision-language model: its positions are its own (multimodal rope), so its prompts are
    prefilled by generate itself, even in a batch without images."""
    return getattr(model.config, "vision_config", None) is not None


def _contiguous_first_input(module: torch.nn.Module, args: tuple) -> Optional[tuple]:
    if args and isinstance(args[0], torch.Tensor) and not args[0].is_contiguous():
        return (args[0].contiguous(), *args[1:])
    return None


class _UntilCancelled(StoppingCriteria):
    """Ends every row of a generate call at its next token once `cancelled` is set (`cancel`: the
    run's end), so a long completion nobody will train on stops within a token's time."""

    def __init__(self, cancelled: threading.Event) -> None:
        self.cancelled = cancelled

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs) -> torch.BoolTensor:
        return torch.full((input_ids.shape[0],), self.cancelled.is_set(), dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value]


class _LogprobRecorder(LogitsProcessor):
    """The logprobs of the generated tokens, step by step, without keeping every step's logits.

    Generate hands each step's raw logits (float32, before the temperature) to the logits
    processors before it draws the step's token; that token is the last of the next step's
    `input_ids`. So each call scores the previous step's token against the previous step's logits,
    and `finish` scores the last one: one step's `[N, V]` logits are held at a time, where
    `output_logits` would keep all S of them (at a 150k vocabulary, 2.5 GB for 16 rows of 256).
    Both logprobs are those `log_softmax` gives: of `logits / temperature` (the distribution
    sampled from) and of the raw logits, computed without a `[N, V]` output (`chosen_logprobs`).
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.pending_NV: Optional[torch.Tensor] = None
        self.sampling: list[torch.Tensor] = []
        self.raw: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if self.pending_NV is not None:
            self._score(input_ids[:, -1])
        self.pending_NV = scores  # generate's own copy of the step's logits, never written in place
        return scores

    def _score(self, tokens_N: torch.Tensor) -> None:
        assert self.pending_NV is not None  # a step's logits are pending before its token is scored
        sampling_N, raw_N = chosen_logprobs(self.pending_NV, tokens_N.to(self.pending_NV.device), self.temperature)
        self.sampling.append(sampling_N)
        self.raw.append(raw_N)
        self.pending_NV = None

    def finish(self, last_tokens_N: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(sampling, raw) logprobs, each [N, S] on the CPU, once generate has drawn `last_tokens_N`."""
        if self.pending_NV is not None:
            self._score(last_tokens_N)
        return torch.stack(self.sampling, dim=1).cpu(), torch.stack(self.raw, dim=1).cpu()


class _DrawByInverseCdf(LogitsProcessor):
    """Draws each row's token from `softmax(scores / temperature)` (`draw_tokens`) and returns scores
    that put all the mass on it, so generate's greedy step takes it. Runs after `_LogprobRecorder`,
    which keeps the raw scores (never written in place here) and scores the drawn token on them."""

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        tokens_N1 = draw_tokens(scores, self.temperature)[:, None]
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens_N1, 0.0)  # type: ignore[return-value]


def draw_tokens(logits_NV: torch.Tensor, temperature: float) -> torch.Tensor:
    """One token per row drawn from `softmax(logits / temperature)`, by inverting the row's cumulative
    distribution: a uniform draw (torch's global generator) located in the running sum of the
    probabilities, in float64 (float32 on MPS). Exact for the categorical: id i is drawn with probability p_i (to
    float64 rounding of the sums), an id of probability 0 never. It costs a softmax, a cumulative sum
    and a search per row, where `torch.multinomial`, generate's own draw, makes one exponential draw
    per vocabulary entry: 18.6 ms of a 26 ms decode step for 8 rows of 151,936 ids on a 2-core CPU.
    Shapes: `[N, V]` (any float dtype) -> `[N]` int64.
    """
    wide = torch.float32 if logits_NV.device.type == "mps" else torch.float64  # MPS has no float64
    cdf_NV = torch.softmax(logits_NV.to(wide) / temperature, dim=-1).cumsum_(dim=-1)
    uniform_N1 = torch.rand(cdf_NV.shape[0], 1, dtype=cdf_NV.dtype, device=cdf_NV.device) * cdf_NV[:, -1:]
    return torch.searchsorted(cdf_NV, uniform_N1, right=True)[:, 0].clamp_(max=cdf_NV.shape[1] - 1)


def chosen_logprobs(
    logits_NV: torch.Tensor, tokens_N: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The logprobs of `tokens_N` [N] under `logits_NV` [N, V]: (sampling, raw), each [N] float32,
    equal to `log_softmax(logits / temperature).gather(tokens)` and `log_softmax(logits).gather(tokens)`.

    Written as the chosen logit less the row's logsumexp: a [N, V] log_softmax output is written
    (and its pages touched) every decode step only to read N entries back, which at a 150k
    vocabulary cost about 10× the logsumexp on a CPU. At temperature 1 both are the same tensor.
    """
    logits_NV = logits_NV.float()
    chosen_N = logits_NV.gather(-1, tokens_N[:, None])[:, 0]
    raw_N = chosen_N - torch.logsumexp(logits_NV, dim=-1)
    if temperature == 1.0:
        return raw_N, raw_N
    sampling_N = chosen_N / temperature - torch.logsumexp(logits_NV / temperature, dim=-1)
    return sampling_N, raw_N


class _StopStrings(StoppingCriteria):
    """Ends a row's generation once its completion holds a stop string. Each step decodes only the
    last few tokens of each running row (cheap); a hit there is confirmed on the whole completion,
    so a row is ended only where `find_stop` will find its stop. The cut itself is `find_stop`'s."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: tuple[str, ...], prompt_width: int) -> None:
        self.tokenizer, self.stop, self.width = tokenizer, stop, prompt_width
        self.window = max(map(len, stop)) + 4  # tokens: a stop string needs at most one per character, plus slack
        self.ended: dict[int, int] = {}
        """Row -> generated tokens when it was ended (what follows is padding)."""
        self._eos_rows: set[int] = set()

    def __call__(self, input_ids: torch.LongTensor, scores, **kwargs) -> torch.Tensor:
        generated = input_ids.shape[1] - self.width
        recent = input_ids[:, max(self.width, input_ids.shape[1] - self.window) :].tolist()
        eos_id = self.tokenizer.eos_token_id
        running = [i for i, r in enumerate(recent) if i not in self.ended and i not in self._eos_rows]
        self._eos_rows.update(i for i in running if recent[i][-1] == eos_id)  # ended by eos: padding follows
        running = [i for i in running if i not in self._eos_rows]
        texts = self.tokenizer.batch_decode([recent[i] for i in running], skip_special_tokens=True)
        for i, text in zip(running, texts):
            if (
                first_stop(text, self.stop) is not None
                and first_stop(self._decode_row(input_ids, i), self.stop) is not None
            ):
                self.ended[i] = generated
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool)
        done[list(self.ended)] = True
        return done.to(input_ids.device)

    def _decode_row(self, input_ids: torch.Tensor, row: int) -> str:
        return str(self.tokenizer.decode(input_ids[row, self.width :].tolist(), skip_special_tokens=True))


def _tied_aliases(state: dict[str, torch.Tensor]) -> dict[str, set[str]]:
    """For each state-dict name, the names sharing its storage (tied embeddings): loading one loads all."""
    by_pointer: dict[int, set[str]] = {}
    for name, tensor in state.items():
        by_pointer.setdefault(tensor.data_ptr(), set()).add(name)
    return {name: by_pointer[tensor.data_ptr()] for name, tensor in state.items()}


def build_hf_sampler(cfg, weights, tokenizer, *, work_dir: str, seed: int, share_weights: bool = False) -> HFSampler:
    """`sampler.kind=hf`: generates with the policy itself (`share_weights`) or a private copy of it;
    `weights` is the run's `lit_grpo.samplers.StartingWeights`."""
    return HFSampler(weights.policy, tokenizer, max_batch_size=cfg.max_batch_size, share_weights=share_weights)
