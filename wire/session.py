"""Which coordinator process drives a run: work a replaced process asked for is abandoned.

A coordinator that starts (or restarts after a crash) publishes a new session id, retained, on
``topics.coordinator(run)`` before it sends anything, and puts the id in every task. A device
that is still waiting inside a round of another session (for credits, gradients or the edges'
last batches, which will never come now that nobody drives that round) gives up at once instead
of at the round's deadline, so it answers the new coordinator without delay.

The latest announcement is the run's session, whatever its id: a restarted coordinator whose
clock went back (a lower id) is followed, not locked out, and a forged retained id (possible only
on a development broker: the shipped ACL lets the coordinator's account alone publish there) is
replaced as soon as the coordinator sees it and publishes its own again (:class:`SessionGuard`).
A task whose session is not the announced one is given :data:`GRACE_SECONDS` for its own
announcement to arrive (a task may overtake it) before it counts as another process's work.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable

from wire import topics
from wire.transport import Transport

__all__ = ["GRACE_SECONDS", "RoundAbandoned", "SessionGuard", "SessionWatch", "new_session"]

log = logging.getLogger(__name__)
_SESSION = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{8}$")
# How long a task may wait for its own session's announcement (it can overtake it).
GRACE_SECONDS = 3.0


class RoundAbandoned(RuntimeError):
    """The coordinator that asked for this round was replaced; nobody waits for its end."""

    def __init__(self, round_number: int) -> None:
        super().__init__(
            f"round {round_number} abandoned: the coordinator that asked for it was replaced"
        )


def new_session(clock: Callable[[], int] = time.time_ns) -> str:
    """A fresh session id, ordered after every id made earlier."""
    return f"{clock():016x}-{secrets.token_hex(4)}"


class SessionWatch:
    """A device's view of the announced coordinator session of each run it works for."""

    def __init__(
        self,
        transport: Transport,
        grace: float = GRACE_SECONDS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._transport = transport
        self._grace, self._clock = grace, clock
        self._latest: dict[str, tuple[str, float]] = {}  # run -> (session, when it arrived)
        self._watched: set[str] = set()
        self._lock = threading.Lock()

    def watch(self, run: str) -> None:
        """Follow ``run``'s announcements (once per run; the retained one arrives at once)."""
        with self._lock:
            if run in self._watched:
                return
            self._watched.add(run)
        self._transport.subscribe(
            topics.coordinator(run), lambda _topic, payload: self._on_session(run, payload)
        )

    def _on_session(self, run: str, payload: bytes) -> None:
        text = payload.decode("ascii", errors="replace")
        if not _SESSION.match(text):
            if payload:  # an empty payload clears a retained message
                log.warning("dropped a bad coordinator session for run %s: %.80r", run, payload)
            return
        with self._lock:
            if self._latest.get(run, ("", 0.0))[0] != text:
                self._latest[run] = (text, self._clock())

    def follow(self, run: str, session: str | None) -> Callable[[], bool]:
        """Watch ``run`` and return the question a device waiting in a round of ``session``
        asks: has another session replaced it?"""
        self.watch(run)
        started = self._clock()
        return lambda: self.replaced(run, session, started)

    def replaced(self, run: str, session: str | None, since: float | None = None) -> bool:
        """Whether ``run``'s announced session is another than ``session``: announced after
        ``since`` (the task's start), or announced before it and still not ``session`` after
        the grace. Work without a session is never taken for abandoned."""
        if session is None:
            return False
        with self._lock:
            latest, arrived = self._latest.get(run, (None, 0.0))
        if latest is None or latest == session:
            return False
        if since is None:
            return True
        return arrived > since or self._clock() - since > self._grace


class SessionGuard:
    """The coordinator's side: announce ``session`` for ``run`` (retained) and announce it again
    whenever another id appears on the topic, with a warning naming it (at most once a
    second), so a forged or stale retained id cannot hold the devices."""

    def __init__(self, transport: Transport, run: str, session: str) -> None:
        self._transport, self._run, self.session = transport, run, session
        self._last_repair = 0.0
        self.foreign: list[str] = []  # the other ids seen, for tests and status

    def start(self) -> None:
        self._announce()
        self._transport.subscribe(topics.coordinator(self._run), self._on_session)

    def _announce(self) -> None:
        self._transport.publish(topics.coordinator(self._run), self.session.encode(), True)

    def _on_session(self, _topic: str, payload: bytes) -> None:
        if payload == self.session.encode():
            return
        seen = payload[:40].decode("ascii", errors="replace")
        self.foreign.append(seen)
        now = time.monotonic()
        if now - self._last_repair < 1.0:
            return
        self._last_repair = now
        log.warning(
            "run %s: session topic holds %r, not this coordinator's %s (another coordinator "
            "process for the run, or a forgery); announcing %s again",
            self._run,
            seen,
            self.session,
            self.session,
        )
        self._announce()
