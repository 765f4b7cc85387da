"""`lit_grpo_gloo`: a CPU weight-transfer backend for vLLM's weight-transfer API (worker and trainer side).

vLLM's built-in backends (NCCL, CUDA IPC, ...) need CUDA. This one moves the same bytes over a
`torch.distributed` gloo process group, created outside the global one
(`vllm.distributed.utils.stateless_init_torch_distributed_process_group`), so it runs where
vLLM's CPU build does. It follows the dense NCCL backend's protocol exactly:

- init (once): the trainer is rank 0 and hosts the rendezvous (a TCPStore at
  `master_address:master_port`); each inference worker joins as rank
  `rank_offset + dp_index * world_size_per_dp + worker_rank` (`/init_weight_transfer_engine`).
- per sync: `/start_weight_update` (vLLM's layerwise reload is set up), `/update_weights` with
  the names, dtypes and shapes while the trainer broadcasts the bytes, `/finish_weight_update`.

The tensors travel packed: consecutive tensors are laid out (64-byte aligned) in byte buffers of
at most `buffer_size_bytes` (a larger tensor travels alone), one broadcast per buffer; both sides
cut the buffers from the same metadata (`chunk_plan`). Every collective has the group's timeout
(`timeout_s`), so a peer that is gone is an error, never a hang.

Imported by vLLM's factories only when the backend is selected (see `lit_grpo.samplers.server.vllm_plugin`).
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, ClassVar, Self

import torch
from vllm.distributed.weight_transfer.base import (
    ParamMeta,
    TrainerInitInfo,
    TrainerWeightTransferEngine,
    VLLMWeightSyncClient,
    WeightSource,
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from lit_grpo.samplers.server.vllm_plugin import GLOO_BACKEND

ALIGN = 64
DEFAULT_BUFFER_SIZE_BYTES = 64 << 20


def chunk_plan(nbytes: list[int], limit: int) -> list[list[tuple[int, int]]]:
    """Buffers of `(tensor index, byte offset)`: tensors in order, each at a 64-byte aligned
    offset, a new buffer whenever the next tensor would pass `limit` bytes."""
    plan: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    end = 0
    for i, n in enumerate(nbytes):
        offset = -(-end // ALIGN) * ALIGN
        if current and offset + n > limit:
            plan.append(current)
            current, offset = [], 0
        current.append((i, offset))
        end = offset + n
    if current:
        plan.append(current)
    return plan


def _buffer_size(chunk: list[tuple[int, int]], nbytes: list[int]) -> int:
    last, offset = chunk[-1]
    return offset + nbytes[last]


def _nbytes(dtype: torch.dtype, shape: Any) -> int:
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * torch.empty((), dtype=dtype).element_size()


def open_group(master_address: str, master_port: int, rank: int, world_size: int, timeout_s: float):
    """The gloo group of trainer (rank 0) and inference workers, outside the global process group."""
    from vllm.distributed.utils import stateless_init_torch_distributed_process_group

    return stateless_init_torch_distributed_process_group(
        master_address, master_port, rank, world_size, backend="gloo", timeout=timedelta(seconds=timeout_s)
    )


def close_group(group: Any) -> None:
    try:
        group.shutdown()
    except Exception:  # an older torch, or a group already broken by a dead peer
        pass


@dataclass(kw_only=True)
class GlooWeightTransferInitInfo(WeightTransferInitInfo):
    """Worker-side init info (what `/init_weight_transfer_engine` receives)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    timeout_s: float = 300.0
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES


@dataclass
class GlooWeightTransferUpdateInfo(WeightTransferUpdateInfo):
    """Per-sync update info (what `/update_weights` receives): the tensors, in broadcast order."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not len(self.names) == len(self.dtype_names) == len(self.shapes):
            raise ValueError(
                f"names, dtype_names and shapes differ in length: {len(self.names)}, "
                f"{len(self.dtype_names)}, {len(self.shapes)}"
            )


class GlooWeightTransferEngine(WeightTransferEngine[GlooWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
    """Worker side: joins the gloo group, receives the packed buffers, loads them with the
    model's `load_weights` inside vLLM's layerwise reload (as the dense NCCL engine does)."""

    init_info_cls = GlooWeightTransferInitInfo
    update_info_cls = GlooWeightTransferUpdateInfo

    def __init__(self, config, vllm_config, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: Any = None
        self.buffer_size_bytes = DEFAULT_BUFFER_SIZE_BYTES

    def init_transfer_engine(self, init_info: GlooWeightTransferInitInfo) -> None:
        if self.group is not None:  # the trainer starts over (e.g. the set of servers changed)
            close_group(self.group)
            self.group = None
        pc = self.parallel_config
        rank = init_info.rank_offset + pc.data_parallel_index * pc.world_size + pc.rank
        self.buffer_size_bytes = init_info.buffer_size_bytes
        self.group = open_group(
            init_info.master_address, init_info.master_port, rank, init_info.world_size, init_info.timeout_s
        )

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def update_weights(self, update_info: dict[str, Any]) -> None:
        # The base class ends with torch.accelerator.synchronize(), which raises without an accelerator.
        self.receive_weights(self.parse_update_info(update_info))
        if self.device.type != "cpu" and torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
        if self.group is None:
            raise RuntimeError(
                "lit_grpo_gloo weight transfer is not initialized: call /init_weight_transfer_engine first"
            )
        dtypes = [getattr(torch, d) for d in update_info.dtype_names]
        nbytes = [_nbytes(d, s) for d, s in zip(dtypes, update_info.shapes)]
        for chunk in chunk_plan(nbytes, self.buffer_size_bytes):
            buffer = torch.empty(_buffer_size(chunk, nbytes), dtype=torch.uint8)
            self.group.broadcast(buffer, 0).wait()
            weights = [
                (update_info.names[i], buffer[o : o + nbytes[i]].view(dtypes[i]).view(update_info.shapes[i]))
                for i, o in chunk
            ]
            load_weights: Any = self.model.load_weights  # vLLM's model method, not a torch Module's
            load_weights([(n, w.to(self.device)) for n, w in weights])

    def shutdown(self) -> None:
        if self.group is not None:
            close_group(self.group)
            self.group = None


@dataclass
class GlooTrainerInitInfo(TrainerInitInfo):
    """Trainer-side init info: the rendezvous (this process hosts it, as rank 0) and the group size
    (1 + every inference worker of every server)."""

    backend: ClassVar[str] = GLOO_BACKEND

    master_address: str
    master_port: int
    world_size: int
    timeout_s: float = 300.0
    buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES


class GlooTrainerWeightTransferEngine(TrainerWeightTransferEngine[GlooTrainerInitInfo]):
    """Trainer side, rank 0 only: opens the group while the workers join it, then per sync drives
    start / update (concurrently with the broadcasts) / finish through the client."""

    init_info_cls = GlooTrainerInitInfo

    def __init__(
        self,
        *,
        client: VLLMWeightSyncClient,
        source: WeightSource,
        is_sender: bool = True,
        buffer_size_bytes: int = DEFAULT_BUFFER_SIZE_BYTES,
        timeout_s: float = 300.0,
    ) -> None:
        super().__init__(client=client, source=source, is_sender=is_sender)
        self.buffer_size_bytes = buffer_size_bytes
        self.timeout_s = timeout_s
        self.group: Any = None

    @classmethod
    def trainer_init(
        cls, init_info: GlooTrainerInitInfo, *, client: VLLMWeightSyncClient, source: WeightSource | None = None
    ) -> Self:
        if source is None:
            raise ValueError("lit_grpo_gloo weight transfer needs a WeightSource")
        if not init_info.is_sender:
            raise ValueError("lit_grpo_gloo has a single trainer rank, the sender (rank 0)")
        engine = cls(
            client=client, source=source, buffer_size_bytes=init_info.buffer_size_bytes, timeout_s=init_info.timeout_s
        )
        worker_info = GlooWeightTransferInitInfo(
            master_address=init_info.master_address,
            master_port=init_info.master_port,
            rank_offset=1,
            world_size=init_info.world_size,
            timeout_s=init_info.timeout_s,
            buffer_size_bytes=init_info.buffer_size_bytes,
        )
        # The workers block in the rendezvous inside init_weight_transfer_engine: run it beside ours.
        with ThreadPoolExecutor(max_workers=1) as pool:
            future = pool.submit(client.init_weight_transfer_engine, asdict(worker_info))
            try:
                engine.group = open_group(
                    init_info.master_address, init_info.master_port, 0, init_info.world_size, init_info.timeout_s
                )
            finally:
                future.result()  # the server's error first: it says more than a rendezvous timeout
        return engine

    def send_weights(self) -> None:
        assert self.source is not None and self.group is not None, "trainer_init() first"
        meta = self.source.metadata()
        update_info = GlooWeightTransferUpdateInfo(
            names=[m.name for m in meta],
            dtype_names=[str(m.dtype).split(".")[-1] for m in meta],
            shapes=[list(m.shape) for m in meta],
        )
        self.client.start_weight_update()
        pool = ThreadPoolExecutor(max_workers=1)
        try:
            future = pool.submit(self.client.update_weights, asdict(update_info))
            self._broadcast(meta)
            future.result()
        finally:
            pool.shutdown(wait=False)  # after a failed broadcast the request may still be waiting on its timeout
        self.client.finish_weight_update()

    def _broadcast(self, meta: list[ParamMeta]) -> None:
        nbytes = [_nbytes(m.dtype, m.shape) for m in meta]
        tensors = self._checked(meta)
        for chunk in chunk_plan(nbytes, self.buffer_size_bytes):
            buffer = torch.empty(_buffer_size(chunk, nbytes), dtype=torch.uint8)
            for i, offset in chunk:
                tensor = next(tensors)
                buffer[offset : offset + nbytes[i]].copy_(
                    tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
                )
            self.group.broadcast(buffer, 0).wait()
        for extra, _ in tensors:
            raise ValueError(f"the WeightSource yielded more tensors than its metadata declared, first {extra!r}")

    def _checked(self, meta: list[ParamMeta]) -> Iterator[Any]:
        """The source's tensors, each checked against the metadata the workers were sent."""
        assert self.source is not None, "trainer_init() first"
        it = iter(self.source)
        for expected in meta:
            pair = next(it, None)
            name, tensor = pair if pair is not None else (None, None)
            got = (name, tensor.dtype, tuple(tensor.shape)) if tensor is not None else None
            if got != (expected.name, expected.dtype, tuple(expected.shape)):
                raise ValueError(f"the WeightSource disagrees with its metadata at {expected.name!r}: got {name!r}")
            yield tensor
        yield from it

    def shutdown(self) -> None:
        if self.group is not None:
            close_group(self.group)
            self.group = None
