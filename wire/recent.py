"""Tables of what a receiver keeps per sender or stream, bounded by forgetting the least
recently used entry: what a sender writes (topics, names, epochs) cannot grow them."""

from __future__ import annotations

import collections
from collections.abc import Callable, Hashable
from typing import TypeVar

__all__ = ["recent_entry"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


def recent_entry(
    table: collections.OrderedDict[K, V], key: K, make: Callable[[], V], limit: int
) -> V:
    """``table[key]``, made by ``make`` when absent, now the most recently used; beyond
    ``limit`` entries the least recently used are forgotten."""
    entry = table.get(key)
    if entry is None:
        entry = table[key] = make()
        while len(table) > limit:
            table.popitem(last=False)
    else:
        table.move_to_end(key)
    return entry
