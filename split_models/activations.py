"""What crosses a cut: one activation tensor, or a tuple ``(activation, *side)``.

The activation carries the gradient; side tensors (an attention mask, position ids) depend on
no weight (``split_models.autosplit``), so nothing is back-propagated into them. Local heads and
the memory estimate read the activation; every tensor travels, named ``x`` (the activation),
``x.1``, ``x.2``... on the wire, each with its own dtype and shape checked.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "Activation",
    "activation_arrays",
    "detached",
    "nbytes",
    "primary",
    "side",
    "wire_names",
]

Activation = torch.Tensor | tuple[torch.Tensor, ...]


def primary(value: Activation) -> torch.Tensor:
    """The activation itself (what a head reads and the gradient flows through)."""
    return value if isinstance(value, torch.Tensor) else value[0]


def side(value: Activation) -> tuple[torch.Tensor, ...]:
    """The weight-free tensors crossing with it (none for a plain tensor)."""
    return () if isinstance(value, torch.Tensor) else tuple(value[1:])


def detached(value: Activation, requires_grad: bool = False) -> Activation:
    """A copy cut from the graph; with ``requires_grad`` the activation (only) needs one."""
    x = primary(value).detach().requires_grad_(requires_grad)
    rest = side(value)
    return (x, *(t.detach() for t in rest)) if rest else x


def nbytes(value: Activation) -> int:
    tensors = (primary(value), *side(value))
    return sum(t.numel() * t.element_size() for t in tensors)


def wire_names(count: int, stem: str = "x") -> list[str]:
    """The names of ``count`` tensors crossing a cut: ``x``, ``x.1``, ``x.2``... on the wire
    (``stem`` ``y``: an exported segment's outputs)."""
    return [stem, *(f"{stem}.{i}" for i in range(1, count))]


def activation_arrays(value: Activation) -> dict[str, np.ndarray]:
    """The tensors of ``value`` (on the CPU) under their wire names."""
    tensors = (primary(value), *side(value))
    return {
        name: t.detach().cpu().numpy()
        for name, t in zip(wire_names(len(tensors)), tensors, strict=True)
    }
