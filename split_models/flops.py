"""FLOPs of a block's forward pass, for the planner's time estimates."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["count_flops"]


def count_flops(module: nn.Module, batch_input: Any, batch: int) -> int:
    """Forward FLOPs per sample of ``module`` on ``batch_input`` (``batch`` examples) as
    torch's FLOP counter sees them, plus an estimate for the layers with weights it counts
    nothing for (a fused LSTM, an embedding lookup)."""
    calls: list[tuple[nn.Module, tuple[Any, ...], Any]] = []

    def record(layer: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        calls.append((layer, args, output))

    leaves = [m for m in module.modules() if not list(m.children()) and _weights(m)]
    hooks = [m.register_forward_hook(record) for m in leaves]
    counter = FlopCounterMode(display=False)
    try:
        with counter, torch.no_grad():
            module(batch_input)
    finally:
        for hook in hooks:
            hook.remove()
    total = int(counter.get_total_flops())
    for layer, args, output in calls:
        alone = FlopCounterMode(display=False)
        with alone, torch.no_grad():
            layer(*args)
        if alone.get_total_flops() == 0:
            total += _uncounted_flops(layer, args, output)
    return total // batch


def _weights(layer: nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters(recurse=False))


def _uncounted_flops(layer: nn.Module, args: tuple[Any, ...], output: Any) -> int:
    """An estimate for a layer with weights that the FLOP counter misses: a lookup moves its
    output once; otherwise each weight is a multiply-add at every position of the input."""
    if isinstance(layer, nn.Embedding | nn.EmbeddingBag):
        out = output if isinstance(output, torch.Tensor) else output[0]
        return int(out.numel())
    first = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if first is None or first.dim() == 0:
        return 2 * _weights(layer)
    positions = first.numel() // max(1, first.shape[-1])
    return 2 * _weights(layer) * positions
