"""Credit-based flow control: a GPU server bounds how many batches each edge has in flight.

The server grants ``window`` credits when an edge's stream opens and one more after each batch
it has processed; an edge spends one credit per batch and blocks when it has none, so a fast
edge cannot flood the broker or the server, and nothing is dropped.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from wire import topics
from wire.channel import Channel
from wire.codec import Envelope
from wire.logs import warn

__all__ = ["STALL_SECONDS", "CreditGate", "CreditGranter"]

log = logging.getLogger(__name__)
_POLL = 0.05
STALL_SECONDS = 10.0  # without a credit this long, an edge says it waits (a frozen server)


class CreditGate:
    """Edge side: ``acquire()`` before sending a batch; credits arrive from the server."""

    def __init__(
        self,
        channel: Channel,
        run: str,
        device: str,
        clock: Callable[[], float] = time.monotonic,
        subscribe: bool = True,
    ) -> None:
        """With ``subscribe=False`` the owner delivers credits through :meth:`on_credit` (an
        edge agent subscribes once for every run, so no credit sent before it learns of a
        run is lost)."""
        self._credits = 0
        self._round = (0, 1)  # (round, attempt): a retried round is a new attempt of it
        self._ahead: dict[tuple[int, int], int] = {}  # credits of attempts not started here
        self._condition = threading.Condition()
        self._clock = clock
        self._device = device
        self.waited_seconds = 0.0
        if subscribe:
            channel.subscribe(
                topics.credit(run, device), self.on_credit, kinds=frozenset({"credit"})
            )

    def on_credit(self, envelope: Envelope) -> None:
        granted, attempt = envelope.meta.get("credits"), envelope.meta.get("attempt", 1)
        valid = isinstance(attempt, int) and not isinstance(attempt, bool) and 0 < attempt < 1000
        if valid and isinstance(granted, int) and 0 < granted <= 1_000_000:
            key = (envelope.round, attempt)
            with self._condition:
                if key != self._round:  # an attempt not started here (yet): kept for it
                    if key in self._ahead or len(self._ahead) < 64:
                        self._ahead[key] = self._ahead.get(key, 0) + granted
                    return
            self.grant(granted)

    def start_round(self, round_number: int, attempt: int = 1) -> None:
        """Forget unused credits: in the new round (or a new attempt of it, when the
        coordinator retries it) the server grants a fresh window, after loading the round's
        weights, so no batch reaches it early. Credits that came for this attempt before it
        started here are taken, whichever attempt was last: a coordinator that resumes from
        an earlier checkpoint (a later one was corrupt) redoes a round this edge has passed,
        and its server's window may come first (dropped as past, it left the edge waiting for
        credits until the round's deadline)."""
        with self._condition:
            self._round = key = (round_number, attempt)
            self._credits = self._ahead.pop(key, 0)
            self._ahead = {r: c for r, c in self._ahead.items() if r > key}
            self._condition.notify_all()

    def grant(self, credits: int) -> None:
        with self._condition:
            self._credits += credits
            self._condition.notify_all()

    @property
    def available(self) -> int:
        with self._condition:
            return self._credits

    def acquire(
        self, timeout: float | None = None, cancelled: Callable[[], bool] | None = None
    ) -> bool:
        """Take one credit, waiting up to ``timeout`` seconds; False if none came, or at once
        when ``cancelled()`` turns true while waiting (the round was abandoned)."""
        started = self._clock()
        stall = started + STALL_SECONDS  # when a wait is said (once a wait)
        with self._condition:
            while self._credits == 0:
                remaining = None if timeout is None else timeout - (self._clock() - started)
                if remaining is not None and remaining <= 0:
                    return False
                if cancelled is not None and cancelled():
                    return False
                if self._clock() >= stall:
                    stall = float("inf")
                    self._stalled(started)
                # Short waits: a grant wakes us at once, and the (injectable) clock decides
                # when the timeout has passed.
                self._condition.wait(_POLL if remaining is None else min(remaining, _POLL))
            self._credits -= 1
        self.waited_seconds += self._clock() - started
        return True

    def _stalled(self, since: float) -> None:
        round_number, attempt = self._round
        warn(
            log,
            ("stalled", self._device),
            "%s: no credit from the GPU servers for %.0f s in round %d (try %d): they are "
            "busy with other edges, frozen or gone; it waits up to the round's deadline",
            self._device,
            self._clock() - since,
            round_number,
            attempt,
            level=logging.INFO,  # an agent's log; a simulation's clients wait their turn
        )


class CreditGranter:
    """Server side: opens a window per edge and returns a credit per processed batch."""

    def __init__(self, channel: Channel, run: str, window: int = 4) -> None:
        if window < 1:
            raise ValueError(f"window: must be >= 1, got {window}")
        self.channel, self.run, self.window = channel, run, window
        self.attempt = 1  # of the round being served: a retried round's credits are apart
        self._opened: set[str] = set()  # devices with a window; credits go only to them
        self._lock = threading.Lock()

    def open(self, device: str, round_number: int = 0) -> None:
        """Grant the initial window of ``round_number`` to ``device``."""
        with self._lock:
            self._opened.add(device)
        self._send(device, self.window, round_number)

    def processed(self, device: str, round_number: int = 0) -> None:
        """One batch of ``device`` in ``round_number`` is done: return its credit."""
        with self._lock:
            if device not in self._opened:
                return
        self._send(device, 1, round_number)

    def _send(self, device: str, credits: int, round_number: int) -> None:
        self.channel.send(
            topics.credit(self.run, device),
            "credit",
            self.run,
            round=round_number,
            meta={"credits": credits, "attempt": self.attempt},
        )
