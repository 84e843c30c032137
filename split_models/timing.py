"""Timing a round's training steps, so the coordinator can measure each device's speed.

A device adds up the seconds its steps took (forward, backward and optimizer step; not the
waits for credits, gradients or the network) and the examples they trained, per cut (a GPU
server trains the batches of several cuts). The first step of a round is left out: it pays
allocations and kernel set-up that later steps do not. The coordinator turns the sums into
FLOP/s with the profile's FLOPs per sample (``coordinator.speed``); the reply's metrics carry
them as ``compute-seconds``, ``compute-steps``, ``compute-cuts`` and ``compute-examples``.
An edge also times its uplink (:class:`LinkClock`: ``uplink-seconds``, ``uplink-bytes``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable

__all__ = ["LinkClock", "StepClock"]

_MIN_WAIT = 0.001  # a shorter wait for acknowledgements is no wait: the link kept up


class StepClock:
    """Seconds and examples of a round's timed steps (the round's first step left out)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        """A new round: the next step is its first, not counted."""
        self.seconds, self.examples, self.steps = 0.0, Counter[int](), 0
        self._first = True

    def start(self) -> float:
        return self._clock()

    def add(self, started: float, examples: dict[int, int]) -> None:
        """One step that began at ``started`` (from :meth:`start`) trained ``examples``
        (cut -> examples)."""
        seconds = self._clock() - started
        if self._first:
            self._first = False
            return
        self.seconds += seconds
        self.steps += 1
        self.examples.update(examples)

    def metrics(self) -> dict[str, float | list[int]]:
        """The reply metrics of the round's timed steps (empty when none was timed)."""
        if not self.examples:
            return {}
        cuts = sorted(self.examples)
        return {
            "compute-seconds": self.seconds,
            "compute-steps": self.steps,
            "compute-cuts": cuts,
            "compute-examples": [self.examples[c] for c in cuts],
        }


class LinkClock:
    """The uplink's rate, from the batches whose acknowledgement the sender had to wait for:
    the link, not the next step, was the slower, so publication to acknowledgement is the
    transfer. A round where the step always took longer leaves nothing to measure (the link
    is faster than needed, by how much is unknown)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.reset()

    def reset(self) -> None:
        self.seconds, self.bytes = 0.0, 0
        self._pending: tuple[float, int] | None = None

    def published(self, size: int) -> None:
        """A message of ``size`` bytes was handed to the transport now."""
        self._pending = (self._clock(), size)

    def acknowledged(self, waited: float) -> None:
        """Every message handed over is acknowledged now, after waiting ``waited`` seconds."""
        if self._pending is not None and waited > _MIN_WAIT:
            self.seconds += self._clock() - self._pending[0]
            self.bytes += self._pending[1]
        self._pending = None

    def metrics(self) -> dict[str, float | int]:
        """``uplink-seconds`` and ``uplink-bytes`` of the measured transfers (none: empty)."""
        return {"uplink-seconds": self.seconds, "uplink-bytes": self.bytes} if self.bytes else {}
