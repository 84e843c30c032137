"""Built segments shared by the many clients one simulation host runs.

A deployment runs one edge agent a device, each holding its own built segment. A simulation runs
hundreds of clients in one process; holding a model copy, optimizer and warm-up per client makes
the cost grow with the number of clients instead of with the data trained. Agents are stateless
between rounds (every round brings its weights), so clients can borrow a built segment for the
round from a pool: at most ``workers`` clients train at once, segments are built (and warmed up)
once per worker and task, and an idle client holds only its data.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

__all__ = ["SegmentPool"]

T = TypeVar("T")


class SegmentPool(Generic[T]):
    """``workers`` training slots and the built objects they reuse, by task key."""

    def __init__(self, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers: expected an integer >= 1, got {workers}")
        self.workers = workers
        self._slots = threading.BoundedSemaphore(workers)
        self._lock = threading.Lock()
        self._free: dict[str, list[T]] = {}
        self.built = 0  # how many objects were built: at most ``workers`` per key

    @contextmanager
    def borrow(self, key: str, build: Callable[[], T]) -> Iterator[T]:
        """A training slot and an object for ``key`` (built on first need), returned after."""
        with self._slots:
            with self._lock:
                free = self._free.setdefault(key, [])
                item = free.pop() if free else None
            if item is None:
                item = build()
                with self._lock:
                    self.built += 1
            try:
                yield item
            finally:
                with self._lock:
                    self._free.setdefault(key, []).append(item)

    @contextmanager
    def slot(self) -> Iterator[None]:
        """A training slot without a built object (other work that should not run wider)."""
        with self._slots:
            yield

    def forget(self) -> None:
        """Drop every idle built object (a new task replaces the old ones)."""
        with self._lock:
            self._free.clear()
