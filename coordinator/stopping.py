"""Stopping a run from outside: ``edgesplit runs stop`` and the coordinator's answer.

The request is a run event (``stop-requested``), so it needs nothing but the store both sides
already share. A running coordinator watches for new requests (:class:`StopWatch`, a thread
polling the store), answers each with a ``stopping`` event and stops at its next check (each
round's start, and while it waits for replies): the run is then ``cancelled`` and can be
resumed by running the same command again. A request nobody answers means nothing drives the
run, and :func:`request_stop` marks it ``cancelled`` itself.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from coordinator.errors import RunCancelled
from storage.base import RunStore
from storage.records import ENDED_STATUSES, Event

__all__ = [
    "CANCELLED",
    "STOPPING",
    "STOP_REQUESTED",
    "TERMINAL",
    "StopWatch",
    "mark_cancelled",
    "request_stop",
]

log = logging.getLogger(__name__)

STOP_REQUESTED, STOPPING, CANCELLED = "stop-requested", "stopping", "cancelled"
TERMINAL = ENDED_STATUSES


def _requests(store: RunStore, run_id: str) -> int:
    return sum(1 for e in store.events(run_id) if e.kind == STOP_REQUESTED)


def mark_cancelled(store: RunStore, run_id: str, why: str) -> None:
    """Set the run ``cancelled`` with an event saying why."""
    store.set_run_status(run_id, "cancelled")
    store.add_event(run_id, Event(CANCELLED, why))


class StopWatch:
    """Watches ``run_id`` for stop requests made after :meth:`start`; :meth:`check` raises
    :class:`RunCancelled` once one came."""

    def __init__(self, store: RunStore, run_id: str, interval: float = 1.0) -> None:
        self.store, self.run_id, self.interval = store, run_id, interval
        self.requested = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StopWatch:
        seen = _requests(self.store, self.run_id)  # earlier requests were answered before
        self._thread = threading.Thread(target=self._watch, args=(seen,), daemon=True)
        self._thread.start()
        return self

    def _watch(self, seen: int) -> None:
        while not self._closed.wait(self.interval):
            try:
                if _requests(self.store, self.run_id) > seen:
                    self.store.add_event(self.run_id, Event(STOPPING, "stop request received"))
                    self.requested.set()
                    return
            except Exception as error:  # a store hiccup: the next poll tries again
                log.warning("checking run %s for a stop request: %s", self.run_id, error)

    def check(self) -> None:
        if self.requested.is_set():
            raise RunCancelled(f"run {self.run_id}: stopped on request", requested=True)

    def close(self) -> None:
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> StopWatch:
        return self.start()

    def __exit__(self, *_: object) -> None:
        self.close()


def request_stop(
    store: RunStore,
    run_id: str,
    wait: float = 30.0,
    answer_within: float = 5.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """Ask whoever drives ``run_id`` to stop; wait up to ``wait`` s for it to be cancelled.
    When no coordinator holds the run's lease, or none answers in ``answer_within`` s,
    nothing drives the run: mark it cancelled here.
    Returns what happened, one line."""
    status = store.get_run(run_id).status
    if status in TERMINAL:
        return f"run {run_id} is {status}; nothing to stop"
    held = store.lease(run_id)
    if held is None or held.gone():  # no coordinator holds the run: nobody would answer
        mark_cancelled(store, run_id, "stop requested; no coordinator held the run")
        return f"run {run_id} is cancelled (no coordinator was driving it)"
    answers = sum(1 for e in store.events(run_id) if e.kind == STOPPING)
    store.add_event(run_id, Event(STOP_REQUESTED, "edgesplit runs stop"))
    started = clock()
    answered = False
    while clock() - started < wait:
        status = store.get_run(run_id).status
        answered = answered or sum(1 for e in store.events(run_id) if e.kind == STOPPING) > answers
        if status in TERMINAL:
            return f"run {run_id} is {status}" + (" by its coordinator" if answered else "")
        if not answered and clock() - started >= answer_within:
            mark_cancelled(
                store, run_id, f"no coordinator answered a stop request in {answer_within:g} s"
            )
            return f"run {run_id} is cancelled (no coordinator was driving it)"
        sleep(0.2)
    return (
        f"run {run_id}: its coordinator is stopping (still {status} after {wait:g} s); "
        f"`edgesplit runs events {run_id}` shows when it has"
    )
