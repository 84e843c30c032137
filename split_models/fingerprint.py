"""What a model computes, as one digest per block, so that a run notices when its model's code
changed under it.

A run stores only weights; its model is built again from the model section (a zoo name or an
import path) whenever it resumes or is exported. Weight shapes catch a changed layer size, but
not a changed function: ``ReLU`` made ``GELU``, a residual connection dropped, a different
normalisation order. A block's digest covers its module tree as ``repr`` shows it (layer types
and their settings), the generated code of a traced block (``torch.fx``), and the source of
every class in it that is not PyTorch's own (a user's ``forward``).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import re
from collections.abc import Iterable, Sequence

from torch import nn

__all__ = ["changed_blocks", "describe_blocks", "model_fingerprint", "parse_fingerprint"]

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):  # defined in a notebook or generated: its name stands in
        return f"{cls.__module__}.{cls.__qualname__}"


def _stable(text: str) -> str:
    """``text`` without object addresses (``<function f at 0x7f...>``), which differ from one
    process to the next."""
    return _ADDRESS.sub("", text)


def block_digest(block: nn.Module) -> str:
    """16 hex digits over ``block``'s module tree, traced code and non-torch classes' source."""
    digest = hashlib.sha256(_stable(repr(block)).encode())
    digest.update(_stable(str(getattr(block, "code", ""))).encode())  # a GraphModule's forward
    classes = {type(m) for m in block.modules()}
    for cls in sorted(classes, key=lambda c: (c.__module__, c.__qualname__)):
        if not cls.__module__.startswith("torch."):
            digest.update(_source(cls).encode())
    return digest.hexdigest()[:16]


def model_fingerprint(blocks: Iterable[nn.Module]) -> list[str]:
    """One digest per block, in order."""
    return [block_digest(block) for block in blocks]


def parse_fingerprint(text: str) -> list[str] | None:
    """A stored fingerprint (JSON ``{"blocks": [...]}``); None when it is not one."""
    try:
        blocks = json.loads(text).get("blocks")
    except (ValueError, AttributeError):
        return None
    if not isinstance(blocks, list) or not all(isinstance(b, str) for b in blocks):
        return None
    return blocks


def changed_blocks(stored: Sequence[str], current: Sequence[str]) -> list[int]:
    """The blocks whose digests differ (every block when the count changed)."""
    if len(stored) != len(current):
        return list(range(max(len(stored), len(current))))
    return [i for i, (a, b) in enumerate(zip(stored, current, strict=True)) if a != b]


def describe_blocks(indices: Sequence[int], listed: int = 8) -> str:
    """``blocks 2, 3`` (the first ``listed``, then how many more)."""
    shown = ", ".join(map(str, indices[:listed]))
    more = f" and {len(indices) - listed} more" if len(indices) > listed else ""
    return f"block{'s' if len(indices) > 1 else ''} {shown}{more}"
