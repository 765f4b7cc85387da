"""The sampler group: which engine makes the completions (`kind`), how it samples, and the fields
of the vLLM ones (in-process and servers). `kind` is checked against the sampler registry in
`lit_grpo.run.validate`; everything here checks what the group can check alone, naming the field.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

from lit_grpo.config.checks import MAX_TEMPERATURE, require, require_finite

ENGINE_THREADS = ("auto", "worker", "loop")
"""`sampler.engine_thread`."""

LORA_SYNCS = ("auto", "adapter", "merged")
"""`sampler.lora_sync`."""
ADAPTER_SYNC_KINDS = ("hf", "vllm", "vllm_server")
AUTO_ADAPTER_SYNC_KINDS = ("hf", "vllm_server")
"""Where `lora_sync=auto` picks the adapter alone. Not the in-process `vllm`: its engine's LoRA path
made a CPU demo step 0.14 -> 0.5-3.6 s (`make bench-lora-sync`, 2026-11-27), far more than the
sync saves on a small model; `sampler.lora_sync=adapter` asks for it."""
"""The sampler kinds that take a LoRA policy's adapter alone at a weight sync (`sampler.lora_sync=adapter`)."""
SHARE_POLICY_WEIGHTS = ("auto", "true", "false")
"""`sampler.share_policy_weights`."""

SHARDING_STRATEGY_WORDS = ("fsdp", "deepspeed", "model_parallel")
"""A `trainer.strategy` naming one of these may shard the policy: a sampler then needs whole weights of its own."""


def sampler_copy_reason(kind: str, synchronous: bool, weight_sync_interval: int, strategy: str) -> Optional[str]:
    """Why the sampler needs a copy of the policy's weights of its own, or None when nothing can
    make sampling overlap training and the `hf` sampler can generate with the policy itself."""
    if kind != "hf":
        return f"sampler.kind={kind} runs an engine of its own (only hf generates with the trainer's model)"
    if weight_sync_interval == 0:
        return "offpolicy.weight_sync_interval=0: the sampler keeps the base weights on purpose"
    if weight_sync_interval != 1:
        return (
            f"offpolicy.weight_sync_interval={weight_sync_interval}: between syncs the sampler keeps the last "
            "synced weights"
        )
    if not synchronous:
        return (
            "offpolicy.synchronous=false: rollouts run on a thread of their own, beside training (with "
            "offpolicy.max_lag=0 too: rows oversampled for groups the filters may drop can still be "
            "generating when a step's groups are in)"
        )
    if any(word in strategy.lower() for word in SHARDING_STRATEGY_WORDS):
        return f"trainer.strategy={strategy} may shard the policy, and the sampler generates with whole weights"
    return None


def engine_on_loop(engine_thread: str, synchronous: bool) -> bool:
    """Whether the in-process engine runs on the rollout event loop's thread (`sampler.engine_thread`)."""
    return engine_thread == "loop" or (engine_thread == "auto" and synchronous)


@dataclass
class SamplerConfig:
    """The in-process sampler that produces rollouts."""

    kind: str = "hf"
    """A registered sampler (`lit_grpo.samplers`): `hf`, batched transformers `generate`, with the
    policy itself or a copy of its weights (`share_policy_weights`); `vllm`, in-process vLLM;
    `vllm_server`, vLLM OpenAI servers over HTTP (started here, `num_servers`, or running, `server_urls`)."""
    temperature: float = 1.0
    """Sampling temperature; logprobs are reported at this temperature (top_p=1, top_k=0)."""
    max_completion_tokens: int = 8
    """Most tokens generated per completion."""
    max_batch_size: int = 256
    """Most sequences generated together in one batched call."""
    engine_thread: str = "auto"
    """hf, vllm: the thread the engine's batched calls run on. `worker`: a thread of their own, so
    the rollout event loop (tool calls, other rollouts) keeps running during a generate; `loop`:
    the event loop's own thread, blocked for each call, and on a CPU no second torch thread pool
    spinning against the trainer's; `auto`: `loop` when training is synchronous (the loop is the
    trainer's thread), else `worker`."""
    share_policy_weights: str = "auto"
    """hf: generate with the policy itself, not a copy of its weights (no copy in memory, no weight
    sync, generation in the trainer's precision): `auto` where sampling cannot overlap training
    (synchronous training, a sync after every step, an unsharded policy), `true` the same but a config
    error elsewhere, `false` always a copy."""
    dtype: str = "auto"
    """vllm: engine dtype (`auto` follows the model; float32 for exact logprob checks)."""
    max_model_len: Optional[int] = None
    """vllm: longest prompt + completion the engine accepts (null: the model's own limit)."""
    gpu_memory_utilization: float = 0.3
    """vllm on CUDA: fraction of GPU memory for the engine (the rest is the trainer's, colocated)."""
    enforce_eager: bool = False
    """vllm: no CUDA graphs (faster start, slower decode)."""
    tensor_parallel_size: int = 1
    """vllm on CUDA: GPUs the engine shards over."""
    sleep_between_phases: bool = False
    """vllm on CUDA: free the engine's memory while the trainer steps (CPU: ignored, with a log line)."""
    server_urls: list[str] = field(default_factory=list)
    """vllm_server: URLs of running servers to attach to (`python -m lit_grpo.serve`, which sets the
    logprobs mode and weight-update endpoints this sampler needs); their weights are replaced by the
    policy's at start. Set this or `num_servers`."""
    num_servers: Optional[int] = None
    """vllm_server: start this many local servers from the policy's weights (written to the run
    folder; logs in `<output_dir>/servers`), stopped at the end of the run; null: 1 unless
    `server_urls` is set (then none are started)."""
    max_in_flight_per_server: int = 64
    """vllm_server: most requests outstanding at one server (requests go to the least busy one)."""
    request_timeout_s: float = 120.0
    """vllm_server: deadline of one HTTP request (each try of a completion; each step of a weight sync)."""
    max_retries: int = 3
    """vllm_server: retries of a completion after a transient error (connection refused or reset, 5xx,
    timeout), with exponential backoff; past them a server that cannot be reached is dropped (its
    requests go to the others), any other failure is an error naming the server."""
    weight_sync_dir: Optional[str] = None
    """vllm_server: folder the policy's weights are written to for the servers to load at each sync
    (they must be able to read it); null: `<output_dir>/weight_sync`."""
    server_startup_timeout_s: float = 600.0
    """vllm_server with `num_servers`: how long the servers may take to answer `/health`."""
    server_kv_cache_memory_bytes: Optional[str] = None
    """vllm_server with `num_servers`: each server's KV cache (`--kv-cache-memory-bytes`, e.g. 256M);
    null: vLLM's default (CPU: VLLM_CPU_KVCACHE_SPACE, GPU: gpu_memory_utilization)."""
    server_args: list[str] = field(default_factory=list)
    """vllm_server with `num_servers`: more `vllm serve` arguments for every server started."""
    weight_transfer: str = "reload"
    """vllm_server: how weights reach the servers at each sync: `reload` (safetensors in
    `weight_sync_dir`), or streamed by vLLM's weight-transfer API, `gloo` (CPU) or `nccl` (GPU);
    servers attached by `server_urls` must run `lit_grpo.samplers.server.serve --weight-transfer` with the same."""
    api_key_env: str = "LIT_GRPO_SERVER_KEY"
    """vllm_server: the environment variable holding the servers' key, sent on every request (unset or
    empty: no key is sent). The config names where the key is, never the key; servers started here
    get it the same way (`python -m lit_grpo.serve` reads `LIT_GRPO_SERVER_KEY`)."""
    lora_sync: str = "auto"
    """A LoRA policy's weight sync: `adapter` sends only the adapter weights: `hf` with the policy
    itself copies nothing, `hf` on a copy copies the adapter tensors into the copy's own adapters,
    `vllm` and `vllm_server` load the adapter files as a new adapter on the base weights and name it
    in the requests from then on (a server keeps older ones for the requests still running on them);
    `merged` sends every weight, the adapters merged in; `auto`: `adapter` with `hf` and
    `vllm_server` with `weight_transfer=reload`, else `merged` (the in-process `vllm` engine
    generates slower with an adapter than the sync saves: measured in `make bench-lora-sync`).
    Servers attached by `server_urls` must run with runtime LoRA loading on
    (`python -m lit_grpo.serve --lora-rank R`)."""
    max_loras: int = 4
    """vllm_server with adapter sync: adapters a server keeps loaded (`--max-loras`): the newest
    one and those older rollouts may still run on; must exceed offpolicy.max_lag + 1 (the
    in-process `vllm` keeps only the newest: no engine call runs across a sync)."""

    @property
    def lora_sync_mode(self) -> str:
        """`lora_sync` with `auto` resolved (for a LoRA policy; a full one always syncs whole)."""
        if self.lora_sync != "auto":
            return self.lora_sync
        takes_adapter = self.kind in AUTO_ADAPTER_SYNC_KINDS and self.weight_transfer == "reload"
        return "adapter" if takes_adapter else "merged"

    @property
    def servers_to_start(self) -> int:
        """vllm_server: how many local servers the sampler starts (0: it attaches to `server_urls`)."""
        if self.num_servers is not None:
            return self.num_servers
        return 0 if self.server_urls else 1

    def __post_init__(self) -> None:  # `kind` is checked against the sampler registry in lit_grpo.run.validate
        require_finite(self.temperature, "sampler.temperature")
        require(
            0 < self.temperature <= MAX_TEMPERATURE,
            "sampler.temperature",
            f"must be in (0, {MAX_TEMPERATURE:g}], got {self.temperature}",
        )
        require(self.max_completion_tokens > 0, "sampler.max_completion_tokens", "must be > 0")
        require(self.max_batch_size > 0, "sampler.max_batch_size", "must be > 0")
        require(
            self.engine_thread in ENGINE_THREADS,
            "sampler.engine_thread",
            f"must be one of {', '.join(ENGINE_THREADS)}, got {self.engine_thread!r}",
        )
        self.share_policy_weights = str(self.share_policy_weights).lower()  # a YAML true arrives as "True"
        require(
            self.share_policy_weights in SHARE_POLICY_WEIGHTS,
            "sampler.share_policy_weights",
            f"must be one of {', '.join(SHARE_POLICY_WEIGHTS)}, got {self.share_policy_weights!r}",
        )
        require(0 < self.gpu_memory_utilization <= 1, "sampler.gpu_memory_utilization", "must be in (0, 1]")
        require(self.tensor_parallel_size >= 1, "sampler.tensor_parallel_size", "must be >= 1")
        _check_server_fields(self)


def _check_server_fields(cfg: SamplerConfig) -> None:
    """The `vllm_server` fields of `SamplerConfig`."""
    require(cfg.num_servers is None or cfg.num_servers >= 0, "sampler.num_servers", "must be >= 0 or null")
    require(
        all(isinstance(u, str) and u.startswith(("http://", "https://")) for u in cfg.server_urls),
        "sampler.server_urls",
        f"must be http(s):// URLs, got {list(cfg.server_urls)!r}",
    )
    if cfg.kind == "vllm_server":
        require(
            bool(cfg.server_urls) != (cfg.servers_to_start > 0),
            "sampler.server_urls",
            "sampler=vllm_server needs exactly one of sampler.server_urls (attach to running servers) and "
            "sampler.num_servers (start local ones), "
            f"got server_urls={list(cfg.server_urls)!r}, num_servers={cfg.num_servers}",
        )
    require(cfg.max_in_flight_per_server > 0, "sampler.max_in_flight_per_server", "must be > 0")
    require_finite(cfg.request_timeout_s, "sampler.request_timeout_s")
    require(cfg.request_timeout_s > 0, "sampler.request_timeout_s", "must be > 0")
    require(cfg.max_retries >= 0, "sampler.max_retries", "must be >= 0")
    require_finite(cfg.server_startup_timeout_s, "sampler.server_startup_timeout_s")
    require(cfg.server_startup_timeout_s > 0, "sampler.server_startup_timeout_s", "must be > 0")
    require(
        cfg.weight_sync_dir is None or bool(cfg.weight_sync_dir.strip()),
        "sampler.weight_sync_dir",
        "must be null or a non-empty path",
    )
    require(
        cfg.weight_transfer in ("reload", "gloo", "nccl"),
        "sampler.weight_transfer",
        f"must be reload, gloo (CPU) or nccl (GPU), got {cfg.weight_transfer!r}",
    )
    require(
        cfg.weight_transfer == "reload" or cfg.kind == "vllm_server",
        "sampler.weight_transfer",
        f"{cfg.weight_transfer} streams weights to vLLM servers: only sampler=vllm_server takes it, not {cfg.kind}",
    )
    require(
        cfg.lora_sync in LORA_SYNCS,
        "sampler.lora_sync",
        f"must be one of {', '.join(LORA_SYNCS)}, got {cfg.lora_sync!r}",
    )
    require(
        cfg.lora_sync_mode == "merged" or cfg.kind in ADAPTER_SYNC_KINDS,
        "sampler.lora_sync",
        f"adapter sync needs sampler {', '.join(ADAPTER_SYNC_KINDS)} (samplers that load an adapter); "
        f"sampler={cfg.kind} takes merged weights",
    )
    require(
        cfg.lora_sync_mode == "merged" or cfg.weight_transfer == "reload",
        "sampler.lora_sync",
        f"adapter sync writes the adapter to a file the servers load; it does not stream (sampler.weight_transfer="
        f"{cfg.weight_transfer}): set sampler.lora_sync=merged to stream merged weights",
    )
    require(cfg.max_loras >= 2, "sampler.max_loras", f"must be >= 2, got {cfg.max_loras}")
    require(
        bool(re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", cfg.api_key_env)),
        "sampler.api_key_env",
        f"must name an environment variable (the key itself never goes in the config), got {cfg.api_key_env!r}",
    )
