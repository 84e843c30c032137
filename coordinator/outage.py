"""Broker outages, lost batches and devices offline, as the round runner judges a try by.

A coordinator whose own link to the broker dropped during a try cannot trust the try's outcome
(a train message, a reply or a stream's batches may be lost with a SIGKILLed broker's unsaved
state): :class:`LinkWatch` tells the runner, which ends the try, waits until the link and the
try's devices are back, and redoes the round from the last committed weights. These tries are
bounded apart from ``--max-attempts`` (:data:`OUTAGE_TRIES` a round), so a broker restart does
not use up the attempts a failing device gets. A GPU server that names senders ``missing``
batches (a gap in the stream, :func:`missing_batches`) makes the try fail: a round is not
committed with batches lost on the way, except those of a sender missing batches in the try
before too (:func:`fail_repeat_losers`: that sender fails alone). A try that cannot run
(devices offline) waits :func:`retry_delay`, or less, :func:`wait_for_more`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Iterable, Mapping

from flwr.app import Message

from coordinator.recorder import Outcome
from storage.records import DeviceResult

__all__ = [
    "BACK_WAIT_SECONDS",
    "OUTAGE_TRIES",
    "RETRY_CAP_SECONDS",
    "LinkWatch",
    "fail_repeat_losers",
    "lost_senders",
    "missing_batches",
    "retry_delay",
    "wait_for_more",
]

OUTAGE_TRIES = 5
BACK_WAIT_SECONDS = 120.0
_POLL = 0.2
RETRY_BASE_SECONDS, RETRY_CAP_SECONDS = 1.0, 10.0
_WAKE = 0.2  # how often a back-off looks for a device that came back


class LinkWatch:
    """The coordinator's link to the broker (``transport.link_epoch``: one more each time it
    dropped; a transport without one never drops)."""

    def __init__(
        self,
        transport: object,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        tries: int = OUTAGE_TRIES,
        wait: float = BACK_WAIT_SECONDS,
    ) -> None:
        self._transport, self._clock, self._sleep = transport, clock, sleep
        self.tries, self.wait = tries, wait

    def epoch(self) -> int:
        return int(getattr(self._transport, "link_epoch", 0))

    def connected(self) -> bool:
        return bool(getattr(self._transport, "connected", True))

    def wait_back(self, nodes: Collection[int], online: Callable[[], Iterable[int]]) -> bool:
        """Block until the link is up and every one of ``nodes`` is online (True), or
        :attr:`wait` seconds passed (False: the next try runs with whoever is back)."""
        until = self._clock() + self.wait
        while self._clock() < until:
            if self.connected() and set(nodes) <= set(online()):
                return True
            self._sleep(_POLL)
        return False


def missing_batches(servers: Collection[str], replies: Mapping[str, Message]) -> str | None:
    """Why a try whose GPU servers answered cannot commit: one names senders whose batches
    did not all arrive (its report's ``missing``); None when none does."""
    lost = []
    for server in sorted(servers):
        reply = replies.get(server)
        if reply is None or reply.has_error():
            continue
        report = reply.content.config_records.get("report")
        missing = report.get("missing", "") if report is not None else ""
        if isinstance(missing, str) and missing:
            lost.append(f"{server}: batches of {missing[:200]} lost on the way")
    return "; ".join(lost) or None


def lost_senders(servers: Collection[str], replies: Mapping[str, Message]) -> set[str]:
    """The senders a GPU server among ``servers`` says missed batches (its ``missing``)."""
    lost: set[str] = set()
    for server in servers:
        reply = replies.get(server)
        report = None if reply is None or reply.has_error() else reply.content.config_records
        missing = report["report"].get("missing", "") if report and "report" in report else ""
        if isinstance(missing, str) and missing:
            lost |= set(missing.split(","))
    return lost


def fail_repeat_losers(outcome: Outcome, lost: set[str], before: set[str]) -> bool:
    """Fail alone, in ``outcome``, the senders that missed batches in this try (``lost``) as
    in the one before (``before``): a broker losing one sender's messages twice running is
    unlikely, a device saying it sent more than it did does it every try, and redoing the
    round for it would fail the run. True when that leaves no loss to redo the round for
    (what of theirs arrived was trained, all in, as for a sender gone offline)."""
    if not lost or not lost <= before:
        return False
    why = "its batches did not all arrive in two tries running (it said it sent more?)"
    outcome.results[:] = [
        DeviceResult(r.device, failure=why) if r.device in lost else r for r in outcome.results
    ]
    outcome.ok[:] = [d for d in outcome.ok if d not in lost]
    return True


def wait_for_more(
    nodes: Callable[[], Iterable[int]], delay: float, sleep: Callable[[float], None] = time.sleep
) -> None:
    """Wait ``delay`` seconds before the next try of a round that could not run, or less:
    until a node comes online that was not (a restarted GPU server is used at once, not
    after the rest of the back-off)."""
    before, left = set(nodes()), delay
    while left > 0:
        sleep(min(_WAKE, left))
        left -= _WAKE
        if not set(nodes()) <= before:
            return


def retry_delay(
    attempt: int, base: float = RETRY_BASE_SECONDS, cap: float = RETRY_CAP_SECONDS
) -> float:
    """Seconds to wait before the try after ``attempt`` (1, 2, ...) that could not run (a
    piece of the back offline): doubling from ``base``, at most ``cap``. A server restarting
    is back for the next try within seconds; one that stays away is not asked every second."""
    if attempt < 1:
        raise ValueError(f"attempt: must be >= 1, got {attempt}")
    return min(cap, base * 2.0 ** min(attempt - 1, 32))
