"""Timing a round's training steps, so the coordinator can measure each device's speed.

A device adds up the seconds its steps took (forward, backward and optimizer step; not the
waits for credits, gradients or the network) and the examples they trained, per cut (a GPU
server trains the batches of several cuts). The first step of a round is left out: it pays
allocations and kernel set-up that later steps do not. The coordinator turns the sums into
FLOP/s with the profile's FLOPs per sample (``coordinator.speed``); the reply's metrics carry
them as ``compute-seconds``, ``compute-steps``, ``compute-cuts`` and ``compute-examples``.

Beside the wall-clock seconds, the steps' CPU seconds (of the thread that ran them) and the
share of its demand the process's CPU quota allows (``compute-cpu-seconds``, ``cpu-share``,
:mod:`split_models.cpu`): a device under a quota that waited on its link ran each step at full
speed, and the CPU seconds times the share say what it sustains once the steps keep it busy.
An edge also times its uplink (:class:`LinkClock`: ``uplink-seconds``, ``uplink-bytes``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

__all__ = ["LinkClock", "Mark", "StepClock"]

_MIN_WAIT = 0.001  # a shorter wait for acknowledgements is no wait: the link kept up


class Mark(NamedTuple):
    """A moment on both clocks: wall seconds and the thread's CPU seconds."""

    wall: float
    cpu: float


class StepClock:
    """Seconds and examples of a round's timed steps (the round's first step left out).
    ``share``: what the process's CPU quota allows of its training threads' demand
    (:func:`split_models.cpu.cpu_share`; 1: no quota); ``on_cpu``: the steps run on the CPU
    (false: on an accelerator, whose speed a CPU quota does not bound, and whose work the
    thread's CPU seconds miss; then neither is reported)."""

    def __init__(
        self,
        clock: Callable[[], float] = time.perf_counter,
        cpu_clock: Callable[[], float] = time.thread_time,
        share: float = 1.0,
        on_cpu: bool = True,
    ) -> None:
        self._clock, self._cpu_clock, self.share = clock, cpu_clock, share
        self.on_cpu = on_cpu
        self.reset()

    def reset(self) -> None:
        """A new round: the next step is its first, not counted."""
        self.seconds, self.cpu_seconds, self.examples, self.steps = 0.0, 0.0, Counter[int](), 0
        self._first = True

    def start(self) -> Mark:
        return Mark(self._clock(), self._cpu_clock())

    def add(
        self, started: Mark, examples: dict[int, int], paused: tuple[Mark, Mark] | None = None
    ) -> None:
        """One step that began at ``started`` (from :meth:`start`) trained ``examples``
        (cut -> examples); ``paused``: the marks between which it waited (not counted)."""
        now = self.start()
        wall, cpu = now.wall - started.wall, now.cpu - started.cpu
        if paused is not None:
            wall -= paused[1].wall - paused[0].wall
            cpu -= paused[1].cpu - paused[0].cpu
        if self._first:
            self._first = False
            return
        self.seconds += wall
        self.cpu_seconds += max(cpu, 0.0)
        self.steps += 1
        self.examples.update(examples)

    def metrics(self) -> dict[str, float | list[int]]:
        """The reply metrics of the round's timed steps (empty when none was timed)."""
        if not self.examples:
            return {}
        cuts = sorted(self.examples)
        cpu = {"compute-cpu-seconds": self.cpu_seconds, "cpu-share": self.share}
        return {
            "compute-seconds": self.seconds,
            "compute-steps": self.steps,
            "compute-cuts": cuts,
            "compute-examples": [self.examples[c] for c in cuts],
            **(cpu if self.on_cpu else {}),
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
