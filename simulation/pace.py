"""The round's clients step in turns, in proportion to their batches.

A deployment's edges train at once, so a GPU server receives their batches mixed. A
simulation has fewer cores than clients: if each client trained its round alone, a few at a
time, the GPU server would train the back on one client's batches after another's. Under
label skew the back then ends each round fitted to the last clients' classes (one run of
8 Dirichlet(0.5) clients: 0.81 accuracy with one worker, 0.88 with two, 0.96 with eight
threads; docs/benchmarks.md, "The order in which the GPU server sees the clients").

So the clients of a round hold their built segments for the whole round and take turns by
step: the client furthest behind in its share of batches done steps next (ties by name), at
most ``running`` at once. Every client then finishes its round at about the same moment, and
the GPU server sees the round's data mixed as from edges streaming at once, in the same
order in every run where one client steps at a time.

A client that joins late (a training slot freed by one that finished) starts level with the
clients furthest behind, not from zero, so it does not train alone until it catches up. One
that has not come back ``patience`` seconds after its turn came (it waits for a credit from
the GPU server, or it failed) is not waited for again until it does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["Pacer"]

log = logging.getLogger(__name__)


@dataclass
class _Client:
    batches: int
    done: int = 0
    start: float = 0.0  # the share of batches it joined at (a late joiner's level)
    waiting: bool = False
    running: bool = False
    away_since: float = 0.0  # when it last left the pacer (monotonic)

    @property
    def progress(self) -> float:
        return self.start + self.done / self.batches


class Pacer:
    """Turns by step for a round's clients (see the module docstring)."""

    def __init__(
        self,
        running: int,
        patience: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if running < 1:
            raise ValueError(f"running: expected an integer >= 1, got {running}")
        self.running, self.patience, self._clock = running, patience, clock
        self._lock = threading.Condition()
        self._clients: dict[str, _Client] = {}
        self._pending: set[str] = set()  # expected to join before anyone steps
        self._since = clock()  # when the pending were named

    def expect(self, holders: Iterable[str]) -> None:
        """The clients that start the round together: no step is taken before each has
        joined (or ``patience`` seconds have passed)."""
        with self._lock:
            self._pending = set(holders) - set(self._clients)
            self._since = self._clock()
            self._lock.notify_all()

    def join(self, holder: str, batches: int) -> None:
        """``holder`` trains ``batches`` batches this round, level with the clients furthest
        behind."""
        with self._lock:
            level = min((c.progress for c in self._clients.values()), default=0.0)
            self._clients[holder] = _Client(max(1, batches), start=level, away_since=self._clock())
            self._pending.discard(holder)
            self._lock.notify_all()

    def leave(self, holder: str) -> None:
        """``holder``'s round is over (trained, or failed)."""
        with self._lock:
            self._clients.pop(holder, None)
            self._pending.discard(holder)
            self._lock.notify_all()

    @contextmanager
    def turn(self, holder: str) -> Iterator[None]:
        """One step of ``holder``'s, taken in its turn (at once for a client that has not
        joined)."""
        with self._lock:
            client = self._clients.get(holder)
            if client is not None:
                client.waiting = True
                while not self._next(holder):
                    self._lock.wait(self._wake_in())
                client.waiting, client.running = False, True
        try:
            yield
        finally:
            if client is not None:
                with self._lock:
                    client.running, client.done = False, client.done + 1
                    client.away_since = self._clock()
                    self._lock.notify_all()

    def _next(self, holder: str) -> bool:
        """Whether ``holder`` (waiting) steps now."""
        now = self._clock()
        if self._pending and now - self._since < self.patience:
            return False
        if self._pending:
            log.debug(  # slow to build their segments (the first round), or failed
                "%s did not start training within %.0f s; the other clients go on",
                ", ".join(sorted(self._pending)),
                self.patience,
            )
            self._pending = set()
        if sum(c.running for c in self._clients.values()) >= self.running:
            return False
        mine = self._clients[holder]
        return not any(
            (c.progress, name) < (mine.progress, holder)
            for name, c in self._clients.items()
            if name != holder
            and not c.running
            and c.done < c.batches
            and (c.waiting or now - c.away_since < self.patience)
        )

    def _wake_in(self) -> float:
        """How long to wait before looking again, when no one says (someone's patience
        running out)."""
        return max(0.01, min(self.patience, 1.0))
