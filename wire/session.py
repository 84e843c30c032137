"""Which coordinator process drives a run: work a replaced process asked for is abandoned.

A coordinator that starts (or restarts after a crash) publishes a new session id, retained, on
``topics.coordinator(run)`` before it sends anything, and puts the id in every task. A device
that is still waiting inside a round of an earlier session (for credits, gradients or the edges'
last batches, which will never come now that nobody drives that round) gives up at once instead
of at the round's deadline, so it answers the new coordinator without delay.

Session ids order by their start time (16 hex digits of nanoseconds, then 8 random ones), so a
task of the new session that overtakes its retained announcement is not taken for an old one.
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

__all__ = ["RoundAbandoned", "SessionWatch", "new_session"]

log = logging.getLogger(__name__)
_SESSION = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{8}$")


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
    """A device's view of the newest coordinator session of each run it works for."""

    def __init__(self, transport: Transport) -> None:
        self._transport = transport
        self._newest: dict[str, str] = {}
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
            if text > self._newest.get(run, ""):
                self._newest[run] = text

    def follow(self, run: str, session: str | None) -> Callable[[], bool]:
        """Watch ``run`` and return the question a device waiting in a round of ``session``
        asks: has a newer session replaced it?"""
        self.watch(run)
        return lambda: self.replaced(run, session)

    def replaced(self, run: str, session: str | None) -> bool:
        """Whether a coordinator session newer than ``session`` has announced itself for
        ``run`` (work without a session is never taken for abandoned)."""
        if session is None:
            return False
        with self._lock:
            return self._newest.get(run, "") > session
