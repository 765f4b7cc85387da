"""What the parts of `VLLMServerSampler` kept in modules of their own (its weight sync, adapter
sync and scoring, each a mixin) use of the sampler they are mixed into: declared here for the
type checker, set by `VLLMServerSampler.__init__` (lit_grpo/samplers/server/sampler.py).

The router, the replicas, the transport and the streams are typed `Any`: their classes live in
modules that import these mixins' modules, and no import may go round in a cycle, not even one
for types alone (tests/test_layers.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, TypeVar

T = TypeVar("T")


class ServerSamplerState:
    """The sampler's state and helpers its mixins read (annotations only: nothing is set here)."""

    router: Any  # requests.ReplicaRouter
    weight_sync_dir: Path
    request_timeout_s: float
    sync_timeout_s: float
    call_timeout_s: Optional[float]
    transport: Any  # weight_transfer.WeightTransport, or None: weights go by file
    partial_rollouts: bool
    sent_images: bool
    image_token_ids: frozenset[int]
    last_sync_bytes: int
    _streams: Any  # partial.InFlightStreams
    _loop: asyncio.AbstractEventLoop

    if TYPE_CHECKING:

        @property
        def replicas(self) -> list[Any]: ...  # requests.Replica

        @property
        def failovers(self) -> list[str]: ...

        @property
        def version(self) -> int: ...

        @version.setter
        def version(self, value: int) -> None: ...

        def _run(self, coro: Coroutine[Any, Any, T], timeout: Optional[float]) -> T: ...

        def _check_open(self) -> None: ...
