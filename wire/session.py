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

A try's announcement also names the devices out of it, ``<session> <round> <try> out <a>,<b>``:
they answered its task with an error (:meth:`SessionGuard.out`). Their streams have ended, so a
GPU server stops waiting for them (:meth:`SessionWatch.out`) instead of waiting until the
round's deadline for batches or a count that a device failing before training may never send.
It is part of the retained announcement, so a server that starts watching late still hears it.
"""

from __future__ import annotations

import logging
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

from wire import topics
from wire.logs import warn
from wire.transport import Transport

__all__ = [
    "GRACE_SECONDS",
    "RoundAbandoned",
    "SessionGuard",
    "SessionWatch",
    "left_unfinished",
    "new_session",
    "parse_announcement",
]

log = logging.getLogger(__name__)
_SESSION = re.compile(r"^[0-9a-f]{16}-[0-9a-f]{8}$")
# How long a task may wait for its own session's announcement (it can overtake it).
GRACE_SECONDS = 3.0
_FOREIGN_KEPT = 16
_LAST_ROUND = 999_999_999  # the largest round an announcement carries: after every real one
_OUT_MOST = 4096  # devices an announcement names out of a try (a longer list is refused)


class RoundAbandoned(RuntimeError):
    """The coordinator that asked for this round stopped or was replaced (a later session,
    round or try was announced); nobody waits for its end. ``why``: what was announced
    (:meth:`SessionWatch.why`)."""

    def __init__(self, round_number: int, why: str | None = None) -> None:
        why = why or "the coordinator that asked for it stopped or was replaced"
        super().__init__(f"round {round_number} abandoned: {why}")


def left_unfinished(round_number: int, device: str) -> str:
    """Why a device stopped by its operator (SIGTERM, Ctrl-C) ends its round: its own doing,
    not the coordinator's (``device``: its role and name, "edge pi-01")."""
    return f"round {round_number} left unfinished: {device} is stopping"


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
        # run -> (session, its newest (round, attempt), when the session arrived)
        self._latest: dict[str, tuple[str, tuple[int, int], float]] = {}
        # run -> (session, (round, try), the devices out of that try: they answered with an error)
        self._out: dict[str, tuple[str, tuple[int, int], frozenset[str]]] = {}
        self._watched: set[str] = set()
        self._lock = threading.Lock()

    def watch(self, run: str) -> None:
        """Follow ``run``'s announcements (once per run; the retained one arrives at once)."""
        with self._lock:
            if run in self._watched:
                return
            first = not self._watched
            self._watched.add(run)
        if first:
            self._transport.on_reconnect(self._again)
        self._subscribe(run)

    def _subscribe(self, run: str) -> None:
        self._transport.subscribe(
            topics.coordinator(run), lambda _topic, payload: self._on_session(run, payload)
        )

    def _again(self) -> None:
        """After a reconnection, subscribe again: the broker sends each run's retained
        announcement anew. One missed while the link was down (or while a second agent with
        this one's id held its session) left the device inside a stopped or replaced round
        until that round's deadline."""
        with self._lock:
            runs = sorted(self._watched)
        for run in runs:
            self._subscribe(run)

    def _on_session(self, run: str, payload: bytes) -> None:
        announced = _parse(payload)
        if announced is None:
            if payload:  # an empty payload clears a retained message
                warn(log, run, "dropped a bad coordinator session for run %s: %.80r", run, payload)
            return
        session, work, out = announced
        with self._lock:
            kept = self._out.get(run)
            if out and (kept is None or kept[0] != session or kept[1] <= work):
                self._out[run] = (session, work, out)  # the list grows within a try
            latest = self._latest.get(run)
            if latest is None or latest[0] != session:
                self._latest[run] = (session, work, self._clock())
            elif work > latest[1]:
                self._latest[run] = (session, work, latest[2])

    def out(self, run: str, session: str | None, work: tuple[int, int]) -> frozenset[str]:
        """The devices the coordinator names out of ``work`` (round, try) of ``session``: they
        answered its task with an error, so whatever they stream has ended."""
        with self._lock:
            kept = self._out.get(run)
        if session is None or kept is None or kept[:2] != (session, work):
            return frozenset()
        return kept[2]

    def follow(
        self, run: str, session: str | None, work: tuple[int, int] | None = None
    ) -> Callable[[], bool]:
        """Watch ``run`` and return the question a device doing ``work`` (round, attempt) of
        ``session`` asks while it waits: has another session, or a later round or attempt of
        this one, replaced it?"""
        self.watch(run)
        started = self._clock()
        return lambda: self.replaced(run, session, started, work)

    def replaced(
        self,
        run: str,
        session: str | None,
        since: float | None = None,
        work: tuple[int, int] | None = None,
    ) -> bool:
        """Whether ``run``'s announced session is another than ``session``: announced after
        ``since`` (the task's start), or announced before it and still not ``session`` after
        the grace; or, for ``work`` (round, attempt), whether ``session`` has since announced a
        later round or attempt (a retry cancels the earlier attempt on every device). Work
        without a session is never taken for abandoned."""
        if session is None:
            return False
        with self._lock:
            latest = self._latest.get(run)
        if latest is None:
            return False
        announced, newest, arrived = latest
        if announced == session:
            return work is not None and newest > work
        if since is None:
            return True
        return arrived > since or self._clock() - since > self._grace

    def why(self, run: str, session: str | None, work: tuple[int, int]) -> str | None:
        """What replaced ``work`` (round, try) of ``session`` in ``run``, as announced; None
        when nothing was."""
        with self._lock:
            latest = self._latest.get(run)
        if session is None or latest is None or (latest[0] == session and latest[1] <= work):
            return None
        return _why(session, work, latest[:2])

    def explained(self, error: Exception, run: str, session: str | None, work: Any) -> Exception:
        """``error``, a :class:`RoundAbandoned` of ``work`` (round, try) of ``session``, with
        what replaced it (a retry, the next round, another coordinator); others as they are."""
        if not isinstance(error, RoundAbandoned) or not (why := self.why(run, session, work)):
            return error
        return RoundAbandoned(work[0], why)


def _why(session: str, work: tuple[int, int], latest: tuple[str, tuple[int, int]]) -> str:
    """What replaced ``work`` (round, try) of ``session``, ``latest`` being the announced
    session and its newest work."""
    announced, (number, attempt) = latest
    if announced != session:
        return "another coordinator process (a restart, or a second one) drives the run now"
    if number == _LAST_ROUND:
        return "the run was stopped"
    if number > work[0]:
        return f"the coordinator went on to round {number}"
    return (
        f"the coordinator started try {attempt} of it (try {work[1]} did not finish: its time "
        "ran out, or the broker went away; the coordinator's log says which)"
    )


def parse_announcement(payload: bytes) -> tuple[str, tuple[int, int]] | None:
    """``<session>``, ``<session> <round> <attempt>``, or that with ``out <device>,...``
    (None when none of them)."""
    parsed = _parse(payload)
    return None if parsed is None else parsed[:2]


def _parse(payload: bytes) -> tuple[str, tuple[int, int], frozenset[str]] | None:
    """An announcement's session, (round, attempt) and the devices out of that attempt."""
    parts = payload.decode("ascii", errors="replace").split(" ")
    if not _SESSION.match(parts[0]) or len(parts) not in (1, 3, 5):
        return None
    if len(parts) == 1:
        return parts[0], (0, 0), frozenset()
    if not all(p.isdigit() and len(p) <= 9 for p in parts[1:3]):
        return None
    out = frozenset(parts[4].split(",")) if len(parts) == 5 else frozenset()
    if len(parts) == 5 and (parts[3] != "out" or len(out) > _OUT_MOST or not all(map(_named, out))):
        return None
    return parts[0], (int(parts[1]), int(parts[2])), out


def _named(name: str) -> bool:
    try:
        topics.check_name(name, "device")
    except ValueError:
        return False
    return True


class SessionGuard:
    """The coordinator's side: announce ``session`` for ``run`` (retained), then each round's
    attempt as it starts (:meth:`attempt`), and announce again whenever another payload appears
    on the topic, with a warning naming it (at most once a second), so a forged or stale
    retained id cannot hold the devices."""

    def __init__(self, transport: Transport, run: str, session: str) -> None:
        self._transport, self._run, self.session = transport, run, session
        self._payload = session.encode()
        self._work, self._out = (0, 0), set[str]()  # the try under way, the devices out of it
        self._lock = threading.Lock()
        self._last_repair = 0.0
        self.foreign: list[str] = []  # the first other payloads seen (bounded), for tests

    def start(self) -> None:
        self._announce()
        self._transport.subscribe(topics.coordinator(self._run), self._on_session)

    def attempt(self, round_number: int, attempt: int) -> None:
        """Round ``round_number``'s try ``attempt`` starts: devices still at an earlier round
        or try of this session give it up."""
        with self._lock:
            self._work, self._out = (round_number, attempt), set()
            self._payload = f"{self.session} {round_number} {attempt}".encode()
            self._announce()

    def out(self, device: str, round_number: int, attempt: int) -> None:
        """``device`` answered try ``attempt`` of round ``round_number`` with an error: the
        announcement of that try names it, and the GPU servers stop waiting for its stream
        (ignored once another try started, or past :data:`_OUT_MOST` devices)."""
        with self._lock:
            if (round_number, attempt) != self._work or len(self._out) >= _OUT_MOST:
                return
            self._out.add(device)
            listed = ",".join(sorted(self._out))
            self._payload = f"{self.session} {round_number} {attempt} out {listed}".encode()
            self._announce()

    def end(self) -> None:
        """The run stops (cancelled): every device gives up whatever it does for this session
        at once, as it would for a later round (a resumed run announces a new session)."""
        with self._lock:
            self._work, self._out = (_LAST_ROUND, 0), set()
            self._payload = f"{self.session} {_LAST_ROUND} 0".encode()
            self._announce()

    def _announce(self) -> None:
        self._transport.publish(topics.coordinator(self._run), self._payload, True)

    def _on_session(self, _topic: str, payload: bytes) -> None:
        announced = parse_announcement(payload)
        if announced is not None and announced[0] == self.session:
            return  # ours (an earlier attempt's echo may arrive after a later announcement)
        seen = payload[:60].decode("ascii", errors="replace")
        if len(self.foreign) < _FOREIGN_KEPT:  # a flood of forgeries must not grow memory
            self.foreign.append(seen)
        now = time.monotonic()
        if now - self._last_repair < 1.0:
            return
        self._last_repair = now
        log.warning(
            "run %s: session topic holds %r, not this coordinator's %s (another coordinator "
            "process for the run, or a forgery); announcing it again",
            self._run,
            seen,
            self.session,
        )
        self._announce()
