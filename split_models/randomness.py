"""Random numbers a model draws in training (dropout's masks), each trainer from a stream of
its own, so a seeded run gives the same weights however its threads interleave.

torch draws them from one generator per process. A simulation trains its clients and its GPU
server in threads of one process, so with two such threads a dropout mask depended on which
thread drew first: the same seed gave 0.7528 and 0.7327 with ``deterministic: true``. Each
trainer now draws from a :class:`RandomStream` seeded by the run's seed, the device, the round
and the try's batch order (a redone try draws what the try it replaces drew): the stream's
state is swapped into torch's generator for a forward pass and taken out after it, under one
lock per process. A stream whose forward pass drew nothing (a model without dropout) is not
swapped in again, so models that draw nothing keep their threads' forward passes apart.

Backward passes draw nothing (dropout keeps its mask from the forward pass), so only forward
passes take the lock. Whatever else draws or seeds while others train (building a model, which
seeds torch and initialises its weights; a segment's head) does so :func:`apart`: under the
lock, with torch's generator put back after. CPU only: a model on an accelerator draws from
that device's generator.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
from collections.abc import Hashable, Iterator

import torch

__all__ = ["RandomStream", "apart", "stream_seed"]

_LOCK = threading.RLock()  # torch's CPU generator is one per process


def stream_seed(*parts: object) -> int:
    """A 63-bit seed from ``parts`` (the run's seed, a device's name, the round, ...): the
    same parts give the same seed in every process and Python version (no ``hash()``)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextlib.contextmanager
def apart() -> Iterator[None]:
    """Seed or draw (``torch.manual_seed``, weight initialisation) apart from the streams:
    under their lock, and torch's generator as it was afterwards."""
    with _LOCK, torch.random.fork_rng(devices=[]):
        yield


class RandomStream:
    """One trainer's random numbers, apart from every other thread's; with no ``seed``, the
    generator as it stands (a segment's steps before a trainer sets its stream: a warm-up)."""

    def __init__(self, seed: int | None = None) -> None:
        self._state = None if seed is None else torch.Generator().manual_seed(seed).get_state()
        self._draws: dict[Hashable, bool] = {}  # per way in (a segment's entry block)

    @contextlib.contextmanager
    def drawing(self, way: Hashable = None) -> Iterator[None]:
        """Run a forward pass that enters by ``way`` (a batch entering a segment at a later
        block passes fewer layers) with this stream's random numbers."""
        if self._draws.get(way) is False:  # it drew nothing before: it draws nothing now
            yield
            return
        with _LOCK:
            outside = torch.get_rng_state()
            before = outside if self._state is None else self._state
            torch.set_rng_state(before)
            passed = False
            try:
                yield
                passed = True
            finally:
                drawn = torch.get_rng_state()
                if passed:  # a pass that failed early may not have reached its dropout
                    self._draws.setdefault(way, not torch.equal(drawn, before))
                if self._state is not None:
                    self._state = drawn
                    torch.set_rng_state(outside)
