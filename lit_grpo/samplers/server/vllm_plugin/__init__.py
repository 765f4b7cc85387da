"""lit_grpo's vLLM plugin (entry point group `vllm.general_plugins`, see pyproject.toml).

vLLM calls `register()` in each of its processes. It registers the CPU weight-transfer backend
`lit_grpo_gloo` (`lit_grpo.samplers.server.vllm_plugin.gloo`) with vLLM's worker-side and trainer-side factories
by module path: the backend's module is imported only when a server runs with
`--weight-transfer-config '{"backend": "lit_grpo_gloo"}'` (or a trainer asks for it), so the
plugin costs a dictionary entry everywhere else. The trainer calls `register()` itself
(`lit_grpo.samplers.server.weight_transfer`).
"""

from __future__ import annotations

GLOO_BACKEND = "lit_grpo_gloo"
"""The backend name, worker side and trainer side."""


def register() -> None:
    """Register `lit_grpo_gloo` with vLLM's weight-transfer factories (idempotent)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    for factory, cls in (
        (WeightTransferEngineFactory, "GlooWeightTransferEngine"),
        (WeightTransferTrainerFactory, "GlooTrainerWeightTransferEngine"),
    ):
        if GLOO_BACKEND not in factory._registry:
            factory.register_engine(GLOO_BACKEND, "lit_grpo.samplers.server.vllm_plugin.gloo", cls)
