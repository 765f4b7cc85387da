"""A CPU float32 `linear` through oneDNN, for the no-gradient matmuls of few rows by a wide weight.

torch computes a CPU float32 `linear` with MKL's sgemm. On the 2-core AMD EPYC host (AVX2, MKL
2024.2, torch 2.13) that is slow for few rows against a wide weight, the shape of every decode step
and of an LM head: SmolLM2's head, `[32, 576] x [576, 49,152]` (one decode step of 32 rows), ran at
19-26 GFLOP/s against 50-74 through oneDNN, and at 539 rows 60 against 72-83; a whole generate
call of 32 rows × 16 tokens took 5.5 s against 6.5 s. The op is torch's own oneDNN linear
(`torch.ops.mkldnn._linear_pointwise`, the one inductor's CPU backend emits for a linear layer), with
the weight as it is: no prepacked copy to keep in step with the training weights.

It has no autograd formula, so it runs only where no gradient flows through it (`applies`): the
`hf` sampler's generate (`onednn_linears`) and the fused LM head's logits chunks, whose backward is
written by hand. Its results equal `torch.nn.functional.linear`'s to float32 rounding (another
summation order), not bitwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional

import torch

__all__ = ["applies", "linear", "onednn_linears"]


def _onednn_op() -> Optional[Callable[..., torch.Tensor]]:
    """The oneDNN linear op of this torch build, or None (no oneDNN, or a build without the op)."""
    if not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._linear_pointwise
    except (AttributeError, RuntimeError):
        return None


_OP = _onednn_op()


def applies(input_NH: torch.Tensor, weight_VH: torch.Tensor) -> bool:
    """Whether `linear` runs oneDNN for these operands: float32 CPU tensors, and no gradient to take
    through them (autograd off, or neither operand requires one)."""
    return (
        _OP is not None
        and input_NH.device.type == "cpu"
        and weight_VH.device.type == "cpu"
        and input_NH.dtype == torch.float32
        and weight_VH.dtype == torch.float32
        and weight_VH.is_contiguous()
        and not (torch.is_grad_enabled() and (input_NH.requires_grad or weight_VH.requires_grad))
    )


def linear(input_NH: torch.Tensor, weight_VH: torch.Tensor, bias_V: Optional[torch.Tensor] = None) -> torch.Tensor:
    """`torch.nn.functional.linear(input, weight, bias)`, through oneDNN where it `applies`, else torch's own.
    Shapes: `[..., H]`, `[V, H]`, `[V]` -> `[..., V]`."""
    if _OP is None or not applies(input_NH, weight_VH) or (bias_V is not None and bias_V.dtype != torch.float32):
        return torch.nn.functional.linear(input_NH, weight_VH, bias_V)
    return _OP(input_NH, weight_VH, bias_V, "none", [], "")


@contextlib.contextmanager
def onednn_linears(model: torch.nn.Module) -> Iterator[None]:
    """Every `nn.Linear` of `model` computes through `linear` until the block ends (its own forward
    again after): for generation, where no gradient is taken. Hooks still run (only `forward` is
    replaced, on the instance). Nothing is changed where this torch has no oneDNN linear."""
    if _OP is None:
        yield
        return
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and "forward" not in vars(m)]
    for layer in layers:
        layer.forward = _forward_of(layer)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _forward_of(layer: torch.nn.Linear) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(input_NH: torch.Tensor, *_: Any) -> torch.Tensor:
        return linear(input_NH, layer.weight, layer.bias)

    return forward
