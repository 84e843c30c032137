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

A client that joins late (a slot freed by one that finished) starts level with the clients
furthest behind, not from zero, so it does not train alone until it catches up. It joins at
the same step in every run: while clients of the round are still to come (:attr:`Pacer.coming`),
no one steps between a client's last step and its leaving, nor between a leaving that hands
its slot over (:meth:`Pacer.leave`) and the next client's joining. (Before, with more
clients than the pool holds at once, whoever finished building first stepped first and a late
client joined wherever the others had got to: the same seed gave 0.6570 to 0.7060 with one
worker.)

Every wait is bounded by ``patience`` seconds, the safety net for a client that failed
without leaving: an expected client that has not joined that long after the latest did, a
handed-over slot not taken, a client that has not come back from its turn (it waits for a
credit from the GPU server) is not waited for again. A run where a bound was reached is not
reproducible.
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
        patience: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if running < 1:
            raise ValueError(f"running: expected an integer >= 1, got {running}")
        self.running, self.patience, self._clock = running, patience, clock
        self._lock = threading.Condition()
        self._clients: dict[str, _Client] = {}
        self._pending: set[str] = set()  # expected to join before anyone steps
        self._since = clock()  # when the pending were named, or the latest of them joined
        self._handover = 0  # slots left by clients and not yet taken by the next
        # whether clients of the round are still to take a slot (the pool says)
        self.coming: Callable[[], bool] = lambda: False

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
            if holder in self._pending:
                self._pending.discard(holder)
                self._since = self._clock()  # the others are not late while some still come
            self._lock.notify_all()

    def admit(self, holder: str) -> None:
        """``holder`` took a slot: one handed over makes it expected (no step before it
        joins); one of the round's first (see :meth:`expect`) is expected already."""
        with self._lock:
            if self._handover:
                self._handover -= 1
                self._pending.add(holder)
                self._since = self._clock()

    def queue(self, holder: str) -> None:
        """``holder`` waits for a slot to be left: it and the clients after it (in name
        order) are not waited for before then."""
        with self._lock:
            self._pending = {name for name in self._pending if name < holder}
            self._handover = 0
            self._lock.notify_all()

    def leave(self, holder: str, hands_over: bool = False) -> None:
        """``holder``'s round is over (trained, or failed); ``hands_over``: the next client
        takes its slot, and no one steps before that client joins."""
        with self._lock:
            self._clients.pop(holder, None)
            self._pending.discard(holder)
            if hands_over:
                self._handover += 1
                self._since = self._clock()
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
        if self._handover and now - self._since < self.patience:
            return False
        self._handover = 0
        if sum(c.running for c in self._clients.values()) >= self.running:
            return False
        if self.coming() and any(
            c.done >= c.batches and now - c.away_since < self.patience
            for c in self._clients.values()
        ):  # a client took its last step: its slot goes to the next before anyone steps
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
