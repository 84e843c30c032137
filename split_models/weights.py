"""Global names for a segment's tensors, shared by every device that holds the same layers.

Blocks are named by their index in the whole model (``block3.conv1.weight``), local-loss heads
by the cut they sit on (``head2.net.1.weight``), so replicas of the same layer on different
devices carry the same keys: aggregation, checkpoints and export all use these names.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch
from torch import nn

from split_models.errors import ModelError
from split_models.segment import Segment

__all__ = ["in_dtypes_of", "load_segment_state", "norm_keys", "segment_state"]


def _named_tensors(segment: Segment) -> list[tuple[nn.Module, dict[str, tuple[str, torch.Tensor]]]]:
    """The segment's blocks and head, each with its ``state_dict`` keys mapped to their global
    names and (uncopied) tensors."""

    def block_name(key: str) -> str:  # "0.conv.weight" of a segment from block 3: block3.conv...
        index, _, rest = key.partition(".")
        return f"block{segment.start + int(index)}.{rest}"

    blocks = _carried(segment.module)
    named = [(segment.module, {key: (block_name(key), t) for key, t in blocks})]
    if not segment.is_last:
        head = _carried(segment.head)
        named.append((segment.head, {key: (f"head{segment.end}.{key}", t) for key, t in head}))
    return named


def _carried(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """``module``'s ``state_dict`` items but its constants: buffers holding NaN or infinity
    (an attention mask of ``-inf``, as ``nn.Transformer.generate_square_subsequent_mask``
    makes). Every process builds them from the model's code; carried as weights, they failed
    every reply's finite check and a strategy's server step (``-inf - -inf`` is NaN)."""
    constants = {
        name
        for name, buffer in module.named_buffers()
        if buffer.is_floating_point() and not bool(torch.isfinite(buffer).all())
    }
    return [(k, t) for k, t in module.state_dict().items() if k not in constants]


def segment_state(segment: Segment) -> dict[str, np.ndarray]:
    """Parameters and buffers of ``segment`` (blocks and head) under their global names; not
    its constants (buffers of NaN or infinity as built: every process builds them)."""
    return {
        name: tensor.detach().cpu().numpy().copy()
        for _, tensors in _named_tensors(segment)
        for name, tensor in tensors.values()
    }


def norm_keys(segment: Segment) -> set[str]:
    """The global names of ``segment``'s BatchNorm tensors (weight, bias, running statistics
    and batch count): what FedBN (``norm: local``) keeps per device."""
    keys = set()
    parts: list[tuple[str, nn.Module]] = [
        (f"block{segment.start + i}.", block) for i, block in enumerate(segment.module.children())
    ]
    if not segment.is_last:
        parts.append((f"head{segment.end}.", segment.head))
    for prefix, part in parts:
        for name, module in part.named_modules():
            if isinstance(module, nn.modules.batchnorm._BatchNorm):
                owner = f"{prefix}{name}." if name else prefix
                for tensor_name, _ in module.named_parameters(recurse=False):
                    keys.add(owner + tensor_name)
                for tensor_name, buffer in module.named_buffers(recurse=False):
                    if buffer is not None:
                        keys.add(owner + tensor_name)
    return keys


def load_segment_state(segment: Segment, arrays: Mapping[str, np.ndarray]) -> None:
    """Load the tensors of ``segment`` from ``arrays`` (which may hold other layers too).

    Every tensor of the segment must be present with its shape, as finite numbers (raises
    :class:`ModelError` naming the first that is not, before anything is loaded); nothing
    else is touched.
    """
    named = _named_tensors(segment)
    wanted = [entry for _, tensors in named for entry in tensors.values()]
    missing = sorted(name for name, _ in wanted if name not in arrays)
    if missing:
        raise ModelError(
            f"weights for blocks [{segment.start}, {segment.end}) lack "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}"
        )
    for name, current in wanted:
        shape, array = tuple(current.shape), np.asarray(arrays[name])
        if array.shape != shape and not _legacy_scalar(array, shape):
            raise ModelError(f"{name}: shape {array.shape}, the segment has {shape}")
        if array.dtype.kind not in "biuf":
            raise ModelError(f"{name}: dtype {array.dtype}, expected numbers")
        if array.dtype.kind == "f" and not np.isfinite(array).all():
            raise ModelError(f"{name}: holds NaN or infinity")

    def tensor(name: str, current: torch.Tensor) -> torch.Tensor:
        array = np.asarray(arrays[name])  # load_state_dict copies: a view is enough
        if not (array.flags.writeable and array.flags.c_contiguous):  # torch refuses those
            array = np.array(array, order="C")
        return torch.from_numpy(array).reshape(current.shape)

    for module, tensors in named:  # a constant (not carried) stays as built
        loaded = {key: tensor(*entry) for key, entry in tensors.items()}
        module.load_state_dict(loaded, strict=len(loaded) == len(module.state_dict()))


def _legacy_scalar(array: np.ndarray, shape: tuple[int, ...]) -> bool:
    """Checkpoints written before 0-d tensors kept their shape hold them as shape (1,)."""
    return shape == () and array.shape == (1,)


def in_dtypes_of(
    model: Mapping[str, np.ndarray], stored: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``stored`` weights in ``model``'s dtypes (those it lacks as they are): a run committed
    by a robust rule before it kept them holds BatchNorm's int64 batch count as float64,
    which devices send back as int64 and the coordinator would refuse as another dtype."""
    return {k: v.astype(model[k].dtype, copy=False) if k in model else v for k, v in stored.items()}
