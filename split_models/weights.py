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

__all__ = ["load_segment_state", "norm_keys", "segment_state"]


def segment_state(segment: Segment) -> dict[str, np.ndarray]:
    """Parameters and buffers of ``segment`` (blocks and head) under their global names."""
    state: dict[str, np.ndarray] = {}
    for key, tensor in segment.module.state_dict().items():
        index, _, rest = key.partition(".")
        state[f"block{segment.start + int(index)}.{rest}"] = tensor.detach().cpu().numpy().copy()
    if not segment.is_last:
        for key, tensor in segment.head.state_dict().items():
            state[f"head{segment.end}.{key}"] = tensor.detach().cpu().numpy().copy()
    return state


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

    Every tensor of the segment must be present with its shape; nothing else is touched.
    """
    wanted = segment_state(segment)
    missing = sorted(set(wanted) - set(arrays))
    if missing:
        raise ModelError(
            f"weights for blocks [{segment.start}, {segment.end}) lack "
            f"{missing[:5]}{'...' if len(missing) > 5 else ''}"
        )
    for key, current in wanted.items():
        if arrays[key].shape != current.shape and not _legacy_scalar(arrays[key], current):
            raise ModelError(f"{key}: shape {arrays[key].shape}, the segment has {current.shape}")

    def tensor(key: str) -> torch.Tensor:
        return torch.from_numpy(np.array(arrays[key]).reshape(wanted[key].shape))

    segment.module.load_state_dict(
        {
            key: tensor(
                f"block{segment.start + int(key.partition('.')[0])}.{key.partition('.')[2]}"
            )
            for key in segment.module.state_dict()
        }
    )
    if not segment.is_last:
        segment.head.load_state_dict(
            {key: tensor(f"head{segment.end}.{key}") for key in segment.head.state_dict()}
        )


def _legacy_scalar(array: np.ndarray, current: np.ndarray) -> bool:
    """Checkpoints written before 0-d tensors kept their shape hold them as shape (1,)."""
    return current.ndim == 0 and array.shape == (1,)
