"""LoRA training: the policy wrapped with peft adapters, its reference, and the merged weights a sampler loads.

- `apply_lora(policy, cfg, seed)`: peft's `get_peft_model`; only the adapters require grad, the
  base weights stay frozen (and bitwise unchanged by training).
- `AdapterFreeView(policy)`: the KL reference, i.e. the same model with its adapters disabled,
  with no second copy of the weights.
- `merged_lora_tensors(named, layers)`: a weight-sync stream of the peft model's state dict turned
  into the base model's: each adapted linear as W + scale·B·A under its base name, without
  `base_model.model.`, `.base_layer` or any `lora_A` / `lora_B` entry. It merges one layer at a
  time from the streamed tensors (never the live model, never a whole copy), so it works on the
  full tensors `lit_grpo.models.weights.full_named_tensors` gathers under any strategy.

- `adapter_tensors(named)` / `base_tensors(named)`: the same stream split the other way, for a
  sampler that serves the adapter on top of the base model (vLLM's runtime LoRA): the adapters
  alone under the names peft saves them with, or the base model's own weights, unmerged.

peft is imported only when LoRA is on (it is an optional dependency).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from lit_grpo.config import ConfigError, LoraConfig
from lit_grpo.maths.head_logprobs import LMHeadSplit, split_lm_head

ADAPTER = "default"  # peft's name for the one adapter get_peft_model adds
PEFT_PREFIX = "base_model.model."  # what PeftModel puts before the base model's names
_WRAPPER_PARTS = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def apply_lora(policy: nn.Module, cfg: LoraConfig, seed: int) -> nn.Module:
    """`policy` (modified in place) wrapped by peft with rank-`cfg.rank` adapters on `cfg.target_modules`.

    The adapters' init is drawn from `seed` with the global RNG left untouched, so it is the same
    on every rank and in a resumed run. Raises `ConfigError` naming `model.lora.target_modules`
    when no layer matches, or a matched layer is not a linear one (only those merge by name here).
    """
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
    except ImportError as err:
        raise ImportError(f"model.lora.rank > 0 needs peft: pip install peft ({err})") from None
    targets = cfg.target_modules if isinstance(cfg.target_modules, str) else list(cfg.target_modules)
    peft_cfg = PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.scale_alpha(),  # type: ignore[arg-type]  # peft says int; a float scales
        lora_dropout=0.0,
        target_modules=targets,
        bias="none",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = get_peft_model(policy, peft_cfg)
        except ValueError as err:  # no target module found in the model
            raise ConfigError(f"config field `model.lora.target_modules`: {err}") from None
    others = sorted(
        {type(m).__name__ for m in model.modules() if isinstance(m, LoraLayer) and not isinstance(m, LoraLinear)}
    )
    if others:
        raise ConfigError(
            f"config field `model.lora.target_modules`: adapters on linear layers only, these are {', '.join(others)}"
        )
    return model


def is_lora(model: nn.Module) -> bool:
    """Whether `model` is a peft model with LoRA adapters (without importing peft when it is not loaded)."""
    return "peft" in sys.modules and hasattr(model, "disable_adapter") and bool(lora_layers(model))


class AdapterFreeView:
    """The policy with its adapters disabled, called like a model: a LoRA run's KL reference.

    Not an `nn.Module`, so it registers no second copy of the policy in the LightningModule (its
    state dict, the optimizer and the checkpoints see the policy once).
    """

    def __init__(self, policy: nn.Module) -> None:
        self._policy: Any = policy  # a peft model (peft is an optional extra: not imported for its type)

    def __call__(self, *args, **kwargs):
        with self._policy.disable_adapter():
            return self._policy(*args, **kwargs)

    def eval(self) -> AdapterFreeView:
        return self  # the policy's own mode applies (GRPOModule keeps it in eval)

    def get_base_model(self) -> nn.Module:
        """The transformers model under the adapters (whose forward's arguments this view takes)."""
        return self._policy.get_base_model()

    def lm_head_split(self) -> tuple[LMHeadSplit | None, str]:
        """The policy's body and head for the fused LM head (`split_lm_head`), the body run with the
        adapters off, as this view's own forward is."""
        split, why_not = split_lm_head(self._policy)
        if split is None:
            return None, why_not
        policy_body = split.body

        def body(
            input_ids: torch.Tensor,
            attention_mask: torch.Tensor | None,
            position_ids: torch.Tensor | None = None,
            **attention_kwargs: Any,
        ) -> torch.Tensor:
            with self._policy.disable_adapter():
                return policy_body(input_ids, attention_mask, position_ids, **attention_kwargs)

        return LMHeadSplit(body, split.head), ""


def _clean(name: str) -> str:
    """A module name without wrapper parts (DDP's leading `module.`, FSDP1's, compile's)."""
    for part in _WRAPPER_PARTS:
        name = name.replace(part, "")
    while name.startswith("module."):
        name = name[len("module.") :]
    return name


def lora_layers(model: nn.Module, prefix: str = "") -> dict[str, tuple[float, bool]]:
    """The LoRA linears of `model` under `prefix` (stripped): state-dict name of the layer ->
    (scaling, fan_in_fan_out) of its active adapter. Empty when peft is not loaded or there are none."""
    if "peft" not in sys.modules:
        return {}
    from peft.tuners.lora import LoraLayer

    layers = {}
    for name, module in model.named_modules():
        name = _clean(name)
        if isinstance(module, LoraLayer) and name.startswith(prefix) and ADAPTER in module.scaling:
            layers[name[len(prefix) :]] = (
                float(module.scaling[ADAPTER]),
                bool(getattr(module, "fan_in_fan_out", False)),
            )
    return layers


def base_name(name: str) -> str:
    """A peft state-dict name as the base model's:
    `base_model.model.x.q_proj.base_layer.weight` -> `x.q_proj.weight`."""
    if name.startswith(PEFT_PREFIX):
        name = name[len(PEFT_PREFIX) :]
    return name.replace(".base_layer.", ".")


def merged_weight(
    weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float, fan_in_fan_out: bool
) -> torch.Tensor:
    """W + scale·B·A as peft's merge computes it (`get_delta_weight`, float32 on CPU for half dtypes)."""
    half_on_cpu = lora_b.device.type == "cpu" and lora_b.dtype in (torch.float16, torch.bfloat16)
    a, b = (lora_a.float(), lora_b.float()) if half_on_cpu else (lora_a, lora_b)
    delta = b @ a
    delta = (delta.T if fan_in_fan_out else delta) * scaling
    return weight + delta.to(device=weight.device, dtype=weight.dtype)


def merged_lora_tensors(
    named: Iterable[tuple[str, torch.Tensor]], layers: dict[str, tuple[float, bool]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """The base model's `(name, tensor)` pairs from a peft model's: adapted weights merged, names un-wrapped.

    `layers` is `lora_layers(...)` with the same naming as `named`. A layer's base weight is held
    until its A and B have streamed past (they follow it in state-dict order), so at most a layer's
    weights are held at once. Other tensors pass through under their base names.
    """
    suffixes = {f".lora_A.{ADAPTER}.weight": "A", f".lora_B.{ADAPTER}.weight": "B", ".base_layer.weight": "W"}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        part = next(
            ((name[: -len(s)], p) for s, p in suffixes.items() if name.endswith(s) and name[: -len(s)] in layers), None
        )
        if part is None:
            if ".lora_" not in name:  # adapters of another name or kind are not part of the base model
                yield base_name(name), tensor
            continue
        layer, which = part
        held = pending.setdefault(layer, {})
        held[which] = tensor
        if len(held) == 3:
            del pending[layer]
            yield base_name(f"{layer}.weight"), merged_weight(held["W"], held["A"], held["B"], *layers[layer])
    if pending:
        raise RuntimeError(f"LoRA layers without their base weight or adapters in the stream: {sorted(pending)[:3]}")


def with_lora(policy: nn.Module, cfg: LoraConfig, seed: int) -> nn.Module:
    """The policy to train: `apply_lora` when `cfg.rank > 0` (unless it has adapters already), else `policy`."""
    if cfg.rank == 0 or is_lora(policy):
        return policy
    return apply_lora(policy, cfg, seed)


def adapter_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The adapters of a peft model's `(name, tensor)` stream, named as peft saves them
    (`base_model.model.x.q_proj.lora_A.weight`, the adapter's name dropped), for
    `adapter_model.safetensors`; every other tensor is left out."""
    for name, tensor in named:
        for part in (".lora_A.", ".lora_B."):
            if name.endswith(f"{part}{ADAPTER}.weight"):
                yield name.replace(f"{part}{ADAPTER}.", part), tensor


def base_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A peft model's stream as its base model's, the adapters left out (not merged)."""
    for name, tensor in named:
        if ".lora_" not in name:
            yield base_name(name), tensor


def base_model(policy: nn.Module) -> nn.Module:
    """The transformers model under a LoRA policy's adapters (peft's `get_base_model`)."""
    peft_model: Any = policy  # a peft model (peft is optional: not imported for its type)
    return peft_model.get_base_model()


def adapter_config(policy: nn.Module):
    """The peft `LoraConfig` of `policy`'s adapter (its `save_pretrained` writes `adapter_config.json`)."""
    peft_config: Any = policy.peft_config  # a peft model's (peft is optional: not imported for its type)
    return peft_config[ADAPTER]
