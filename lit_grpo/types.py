"""Public data types: what a rollout function returns, what a sampler returns, what a step trains on.

Shapes: P prompts, G completions per prompt, B = P·G sequences, T tokens. A mask's 1 means
"trained on".
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class RolloutSample:
    """One trajectory, flattened; `tokens`, `logprobs` and `loss_mask` are parallel lists."""

    tokens: list[int]
    """Prompt + completion (+ tool/user turns for multi-turn), as token ids."""
    logprobs: list[float]
    """The sampler's logprob of each token; 0.0 where the token was not generated."""
    loss_mask: list[int]
    """1 on tokens the policy generated and is trained on, 0 elsewhere (prompt, user, tool)."""
    reward: float
    """Scalar reward of the whole trajectory."""
    finish_reason: str = "stop"
    """`stop` (end-of-sequence), `length` (hit max tokens), or anything a rollout reports."""
    text: str = ""
    """The decoded completion, for logs."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Per-sample values to log as their mean over the step's samples (e.g. each component of a
    weighted reward, `reward/<name>`); a key missing from a sample is not applicable to it."""
    raw_logprobs: Optional[list[float]] = None
    """Optional, parallel to `tokens`: the engine's raw logprobs (`Completion.inference_logprobs`),
    for drift diagnostics only; the loss and TIS use `logprobs`."""
    turn_spans: Optional[list[tuple[int, int]]] = None
    """Optional, for turn-level credit (`advantage=igpo`): the `[start, end)` index
    ranges into `tokens` of each assistant turn, in order, not overlapping."""
    turn_rewards: Optional[list[float]] = None
    """Optional, parallel to `turn_spans`: each turn's reward (IGPO: its information gain,
    `lit_grpo.advantages.igpo.information_gains`); the outcome stays in `reward`."""
    token_versions: Optional[list[int]] = None
    """Optional, parallel to `tokens`: the policy version of the weights that generated each token
    (`Completion.token_versions`), -1 where the policy generated none (prompt, environment). With
    partial rollouts a trajectory spans weight syncs; the off-policy gate counts its group at the
    oldest version among its tokens (`oldest_token_version`)."""
    multi_modal: Optional[dict[str, torch.Tensor]] = None
    """Optional, a vision-language policy's: the prompt's images as its processor made them, the
    keyword tensors of the model's forward besides the token ids (Qwen2-VL: `pixel_values`
    `[patches, C·t·p·p]` and `image_grid_thw` `[images, 3]`), on the CPU. The policy, reference and
    old-policy forwards take them with `tokens` (`RolloutBatch.multi_modal`); their placeholder
    tokens are in the prompt, never trained on. None: a text-only sample."""


def oldest_token_version(samples: list[RolloutSample]) -> Optional[int]:
    """The oldest version among the generated tokens of `samples` (None: none reports versions)."""
    versions = [v for s in samples if s.token_versions for v in s.token_versions if v >= 0]
    return min(versions) if versions else None


def versions_spanned(samples: list[RolloutSample]) -> int:
    """The most versions one sample's generated tokens span: newest - oldest + 1 (1: no sample
    spans a weight sync, or none reports versions)."""
    spans = [1]
    for s in samples:
        versions = [v for v in s.token_versions or () if v >= 0]
        if versions:
            spans.append(max(versions) - min(versions) + 1)
    return max(spans)


@dataclass
class RolloutRun:
    """One rollout call's trajectory as one or more trainable segments (the cookbook's newer contract).

    Every segment trains as its own sequence; the segments share the run's reward, so each gets
    the run's advantage, and the group's statistics count runs, not segments. A multi-turn agent
    whose context is rewritten between turns (summarised, truncated) returns one segment per
    contiguous stretch of tokens. All segments must carry the same `reward`.
    """

    segments: list[RolloutSample]
    """The trainable segments, in order; at least one."""
    run_id: Optional[str] = None
    """The caller's name for the run, for logs."""
    metadata: Optional[dict] = None
    """Anything the caller wants to keep with the run; not used by training."""

    @property
    def reward(self) -> float:
        return self.segments[0].reward


@dataclass
class Completion:
    """One sampled continuation, as a sampler returns it."""

    full_tokens: list[int]
    """Prompt tokens followed by the generated tokens."""
    prompt_len: int
    """How many of `full_tokens` are the prompt."""
    sampling_logprobs: list[float]
    """Logprob of each generated token under the distribution it was sampled from (the policy's
    logits at the sampling temperature; top_p=1, top_k=0), len = len(full_tokens) - prompt_len.
    This is the behaviour policy: what `RolloutSample.logprobs` carries, what the PPO ratio and
    TIS compare the trainer against."""
    finish_reason: str
    """`stop` (end-of-sequence, or a `stop` string: then `stop_reason` names it) or `length` (hit
    `max_tokens` or the request's `max_seq_len`)."""
    text: str
    """The generated tokens decoded (special tokens skipped); cut before a matched stop string."""
    inference_logprobs: Optional[list[float]] = None
    """The engine's raw logprob of each generated token: the model's own distribution at
    temperature 1, before any sampling transform. For drift metrics only, never the behaviour
    policy; equal to `sampling_logprobs` at temperature 1; None when the engine does not report it."""
    stop_reason: Optional[str] = None
    """The stop string that ended the completion, when one did."""
    token_versions: Optional[list[int]] = None
    """Parallel to the generated tokens: the version of the weights that generated each one (a
    sampler with partial rollouts, whose completions span weight syncs); None: not reported."""
    logprobs_echoed: bool = False
    """Always False: lit_grpo's samplers report logprobs of the generated tokens only, never the prompt's."""


@runtime_checkable
class Sampler(Protocol):
    """A generator of completions holding the policy's weights (a copy, or the policy's own for an
    `hf` sampler that shares them): everything the loop asks of one.
    `lit_grpo.samplers.base.BatchingSampler` implements it over one batched engine call, with the
    defaults below; a sampler of your own subclasses it."""

    group_requests: bool
    """True: a request for n completions succeeds or fails as a whole, so the default rollout asks
    for a row's G trajectories in one request (one deadline and retry budget for the group)."""

    async def sample_with_prompt_tokens(
        self, prompt_token_ids: list[int], n: int = 1, **kwargs: Any
    ) -> list[Completion]:
        """Sample `n` completions of a tokenized prompt."""
        ...

    async def sample_with_tokens(self, messages: list[dict], n: int = 1, **kwargs: Any) -> list[Completion]:
        """Apply the policy tokenizer's chat template client-side, then sample `n` completions."""
        ...

    def update_weights(self, named_tensors: Any) -> None:
        """Load `(name, tensor)` pairs of the policy into the sampler's engine, in memory."""
        ...

    def generate(
        self, prompts: list[list[int]], temperature: float, max_tokens: int, stop: tuple[str, ...] = ()
    ) -> list[Completion]:
        """One completion per prompt, called outside the event loop (greedy evaluation: temperature 0)."""
        ...

    def bound_calls(self, timeout_s: Optional[float], max_seq_len: Optional[int], engine_on_loop: bool) -> None:
        """The bounds the data module sets before sampling: a call's deadline, the longest sequence,
        and whether engine calls run on the event loop's thread."""
        ...

    def to_device(self, device: Any) -> None:
        """Move an in-process engine to the trainer's device (default: nothing to move)."""
        ...

    def sleep(self) -> None:
        """Rest while a synchronous step trains: free the engine's memory (vLLM), or keep weights it
        shares with the trainer out of generation's reach until the sync (hf); it wakes itself for
        the next call (default: nothing to do)."""
        ...

    def cancel(self) -> None:
        """End in-flight generation now (the run is ending), from any thread: a running engine call
        stops at its next step and fails with `SamplerClosed`, as does every later call."""
        ...

    def close(self) -> None:
        """Cancel, then stop the engine's threads and processes."""
        ...

    async def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[list[float]]:
        """The policy's logprob of each target token after its prompt, per `(prompt, target)` pair
        (IGPO's information gain; `BatchingSampler` implements it)."""
        ...


@dataclass
class RolloutSetup:
    """Handed once to `make_rollout_fn(setup)`."""

    sampler: Sampler
    """Where completions come from."""
    tokenizer: PreTrainedTokenizerBase
    """The policy's tokenizer."""
    sample_kwargs: dict
    """temperature, max_tokens, top_p=1.0, top_k=0 (no truncation bias in the logprobs)."""
    extras: dict = field(default_factory=dict)
    """User config: `reward_fn(completion_text, row) -> float`, task options."""
    completions_per_prompt: int = 1
    """G: how many times the rollout function is called per row."""
    model: str = ""
    """The policy model's name (a folder, a hub name, or `tiny`)."""
    tokenizer_id: str = ""
    """The tokenizer's name (the model's unless configured otherwise)."""
    inference_base_url: str = ""
    """Empty: lit_grpo's samplers run in-process (a hosted deployment's URL in the cookbook)."""
    api_key: str = ""
    """Empty: no hosted deployment (kept for rollouts written against the cookbook)."""
    processor: Any = None
    """A vision-language policy's processor (`AutoProcessor`: its chat template places a row's
    images, `lit_grpo.tasks.images`); None: a text-only policy."""


@dataclass
class PromptGroup:
    """The G trajectories of one row, and the policy version they count at."""

    row: dict
    """The dataset row the group was sampled from."""
    samples: list[RolloutSample]
    """The trainable sequences of the runs that passed the checks, run after run (None, malformed
    and failed results already dropped); a `RolloutRun` of k segments contributes k of them."""
    version: int
    """Policy version (number of weight syncs) when the row was submitted; with partial rollouts
    (samples that report `token_versions`), the oldest version among the samples' tokens."""
    dropped: Counter = field(default_factory=Counter)
    """Why the row's other rollout calls gave no sample, by metric key (`rollout/dropped_none`,
    `rollout/failures`, ...)."""
    run_sizes: Optional[list[int]] = None
    """Segments per run, in order (sum = len(samples)); None: every sample is a run of its own."""

    @property
    def runs(self) -> list[list[RolloutSample]]:
        """The samples grouped by the rollout call (run) that made them."""
        if self.run_sizes is None:
            return [[s] for s in self.samples]
        starts = itertools.accumulate(self.run_sizes, initial=0)
        return [self.samples[a : a + n] for a, n in zip(starts, self.run_sizes)]

    @property
    def _one_sample_runs(self) -> bool:
        """Every run is one sample (sizes are >= 1 and sum to the samples): no grouping needed."""
        return self.run_sizes is None or len(self.run_sizes) == len(self.samples)

    @property
    def rewards(self) -> list[float]:
        """One reward per run: what group statistics, advantages and filters see."""
        if self._one_sample_runs:
            return [s.reward for s in self.samples]
        return [run[0].reward for run in self.runs]

    def per_sample(self, per_run: list) -> list:
        """Broadcast one value per run to every sample of that run."""
        if self._one_sample_runs:
            return list(per_run)
        return [value for value, run in zip(per_run, self.runs) for _ in run]


@dataclass
class RolloutRecord:
    """What one rank's sampling for one step saw; `rollout_metrics` merges the records of all ranks."""

    rewards: list[float] = field(default_factory=list)
    """Rewards of every sampled group's samples, filtered groups included (they measure the policy too)."""
    completion_tokens: list[int] = field(default_factory=list)
    """Trained-on tokens of each of those samples."""
    counts: Counter = field(default_factory=Counter)
    """Failures and drops since the previous step, by metric key (`rollout/failures`,
    `rollout/dropped_<reason>`, ...)."""
    version_offsets: list[int] = field(default_factory=list)
    """Per accepted group: policy versions between its sampling and this step."""
    timings: dict[str, float] = field(default_factory=dict)
    """This rank's `perf/*` and `async/in_flight` values (the slowest rank's are logged)."""
    sample_metrics: dict[str, list[float]] = field(default_factory=dict)
    """Per key of `RolloutSample.metrics`, the values of the samples that reported it (logged as means)."""
    zero_spread: list[bool] = field(default_factory=list)
    """Per sampled group with at least two runs (filtered groups included): whether all its run
    rewards are equal (`rollout/zero_spread_frac`)."""
    finish_reasons: list[str] = field(default_factory=list)
    """`finish_reason` of each trained sequence (the accepted groups' samples), parallel to `trained_tokens`."""
    trained_tokens: list[int] = field(default_factory=list)
    """Loss-masked tokens of each trained sequence (`rollout/truncated_frac`, `rollout/length_<reason>`)."""
    truncated_masked: Optional[int] = None
    """How many trained sequences `rollout.mask_truncated` masked out of the loss (None: it is off);
    `rollout/truncated_masked_frac` is their share of all ranks' trained sequences."""
    sampled_shapes: list[tuple[int, list[tuple[int, int]]]] = field(default_factory=list)
    """Per sampled group (filtered ones included): the prompt tokens its samples share (0: their
    prompts differ) and each sample's (tokens, generated tokens): what the sampler computed, counted
    by `lit_grpo.maths.flops.sampling_flops` (`perf/flops/sample`)."""


class PromptImages(dict):
    """A prompt's images as the policy's forward takes them: a dict of keyword -> tensor (the
    processor's outputs besides the text ones: Qwen2-VL's `pixel_values`, `image_grid_thw`), which
    is all the trainer and the `hf` sampler read. It also keeps what an engine that runs the
    processor itself (vLLM) needs: `images`, the row's images as loaded (PIL), and
    `template_tokens`, the prompt as the chat template made it, one placeholder per image, before
    the processor expanded each into its image tokens (`expanded_len` tokens in all)."""

    def __init__(
        self,
        tensors: dict[str, torch.Tensor],
        images: Optional[list] = None,
        template_tokens: Optional[list[int]] = None,
        expanded_len: int = 0,
    ) -> None:
        super().__init__(tensors)
        self.images = list(images) if images is not None else None
        self.template_tokens = list(template_tokens) if template_tokens is not None else None
        self.expanded_len = expanded_len

    def engine_prompt(self, prompt_token_ids: list[int]) -> list[int]:
        """`prompt_token_ids` (the expanded prompt, maybe followed by more turns' tokens) with its
        expanded start replaced by `template_tokens`: what an engine that expands the images
        itself takes. `ValueError` when this holds no template (tensors built elsewhere)."""
        if self.template_tokens is None or self.images is None:
            raise ValueError(
                "this prompt's images are tensors only (no images or template tokens): build them with "
                "lit_grpo.rollouts.rollout.row_prompt (lit_grpo.tasks.images.vision_prompt) for a vLLM sampler"
            )
        return self.template_tokens + list(prompt_token_ids[self.expanded_len :])


def _zero_padded(parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """`parts` zero-padded at the end of every dim but the first to the largest: rows with different
    image counts where a processor batches images per row (Idefics3's `pixel_values` [1, images, C,
    H, W]), padded as the processor pads them itself (an all-zero image is padding to the model)."""
    largest = [max(p.shape[d] for p in parts) for d in range(1, parts[0].dim())]
    if all(list(p.shape[1:]) == largest for p in parts):
        return parts
    return [
        torch.nn.functional.pad(p, [x for d in reversed(range(1, p.dim())) for x in (0, largest[d - 1] - p.shape[d])])
        for p in parts
    ]


@dataclass
class MultiModalBatch:
    """The images of a batch's rows: each forward keyword tensor of `RolloutSample.multi_modal`,
    the rows' tensors concatenated along dim 0 in row order, and how many dim-0 entries each row has."""

    tensors: dict[str, torch.Tensor]
    """Keyword -> the rows' tensors concatenated along dim 0 (Qwen2-VL: `pixel_values` [patches, D],
    `image_grid_thw` [images, 3])."""
    sizes_B: dict[str, list[int]]
    """Keyword -> per row, its entries of that tensor along dim 0 (0: a row without images)."""

    @staticmethod
    def of(samples: Sequence[Optional[dict[str, torch.Tensor]]]) -> Optional[MultiModalBatch]:
        """The batch of the rows' `multi_modal` (None for a text-only row); None when no row has images."""
        keys = sorted({k for s in samples if s for k in s})
        if not keys:
            return None
        tensors, sizes = {}, {}
        for key in keys:
            parts = _zero_padded([s[key] for s in samples if s and key in s])
            tensors[key] = torch.cat(parts, dim=0)
            sizes[key] = [int(s[key].shape[0]) if s and key in s else 0 for s in samples]
        return MultiModalBatch(tensors, sizes)

    def select(self, rows: slice | torch.Tensor) -> dict[str, torch.Tensor]:
        """The forward keyword tensors of `rows` (a slice of the batch or row indices), in their
        order; {} when none of them has images."""
        B = len(next(iter(self.sizes_B.values())))
        indices = list(range(B))[rows] if isinstance(rows, slice) else [int(i) for i in rows.tolist()]
        out = {}
        for key, tensor in self.tensors.items():
            sizes = self.sizes_B[key]
            starts = list(itertools.accumulate(sizes, initial=0))
            parts = [tensor[starts[i] : starts[i] + sizes[i]] for i in indices if sizes[i]]
            if parts:
                out[key] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        return out

    def to(self, device: torch.device | str) -> MultiModalBatch:
        return MultiModalBatch({k: v.to(device) for k, v in self.tensors.items()}, self.sizes_B)


@dataclass
class RolloutBatch:
    """Padded tensors for one training step: B = P·G sequences of T tokens (right-padded)."""

    tokens_BT: torch.Tensor
    """Token ids. Shape: [B, T], long."""
    attention_mask_BT: torch.Tensor
    """1 on real tokens, 0 on padding. Shape: [B, T], long."""
    loss_mask_BT: torch.Tensor
    """1 on tokens trained on. Shape: [B, T], float."""
    sampler_logprobs_BT: torch.Tensor
    """Sampler logprob per token (0 where not generated). Shape: [B, T], float."""
    advantages_B: torch.Tensor
    """The advantage of each sequence (`advantage=<name>`). Shape: [B], float."""
    rewards_B: torch.Tensor
    """Reward of each sequence. Shape: [B], float64 (a reward of 1e200 stays finite)."""
    versions_B: torch.Tensor
    """Policy version each sequence was sampled at. Shape: [B], long."""
    record: RolloutRecord = field(default_factory=RolloutRecord)
    """What this rank's sampling for the step saw (rewards of every sampled group, drops, timings)."""
    groups: list[PromptGroup] = field(default_factory=list)
    """The accepted groups the batch was made from, in batch order (host-side, for the sample log)."""
    advantages_BT: Optional[torch.Tensor] = None
    """Per-token advantages (a per-token estimator's, e.g. `advantage=igpo`), parallel to
    `tokens_BT`, 0 outside the turns; the loss then uses these instead of `advantages_B`
    (which holds their mean over each sequence's trained tokens, for logs). Shape: [B, T], float."""
    multi_modal: Optional[MultiModalBatch] = None
    """The rows' images (a vision-language policy's samples), for every forward over `tokens_BT`;
    None: a text-only batch."""

    @property
    def num_sequences(self) -> int:
        return int(self.tokens_BT.shape[0])

    def to(self, device: torch.device | str) -> RolloutBatch:
        """The batch with its tensors (and images) on `device`; the record and the groups (host-side) are shared."""
        return dataclasses.replace(
            self,
            **{
                f.name: getattr(self, f.name).to(device)
                for f in dataclasses.fields(self)
                if isinstance(getattr(self, f.name), (torch.Tensor, MultiModalBatch))
            },
        )
