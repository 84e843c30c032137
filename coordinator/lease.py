"""One coordinator per run: the run's lease (:mod:`storage.lease`) from the coordinator's side.

A coordinator claims the lease before it connects to the broker (two coordinators of a run
share one MQTT client id and would knock each other off) and before it reads or writes the
run. While it drives the run a thread renews the lease every ``ttl / 3`` s; the store renews
it again in every write to the run, which fails once another coordinator took it over.

A lease held by someone else is taken over when its holder is gone:

- at once when the holder ran on this host and its process no longer exists (a coordinator
  killed with ``kill -9`` and started again);
- otherwise once it has not been renewed for ``ttl`` s (a coordinator on another host that
  died, or lost its database for that long).

A holder that renews while a newcomer watches is alive: the newcomer stops with
:class:`RunHeldError`, naming it, within about ``ttl / 3`` s.
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

from coordinator.errors import RunHeldError
from split_models.errors import ConfigError
from storage.base import RunStore
from storage.lease import Lease, lost_error, process_alive
from storage.records import utcnow

__all__ = ["LEASE_TTL", "RunLease"]

log = logging.getLogger(__name__)

LEASE_TTL = 30.0  # seconds without a renewal after which a lease is anybody's
_POLL = 0.5


class RunLease:
    """The lease on ``run_id`` for this coordinator: :meth:`acquire`, :meth:`check` at each
    step of the run, :meth:`release` at its end."""

    def __init__(
        self,
        store: RunStore,
        run_id: str,
        ttl: float = LEASE_TTL,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
        alive: Callable[[int], bool] = process_alive,
    ) -> None:
        if not 1.0 <= ttl <= 3600.0:
            raise ConfigError(f"--lease-seconds: expected 1 to 3600 s, got {ttl:g}")
        self.store, self.run_id, self.ttl = store, run_id, ttl
        self.holder = secrets.token_hex(16)
        self.host, self.pid = socket.gethostname(), os.getpid()
        self._clock, self._sleep, self._alive = clock, sleep, alive
        self.replaced: Lease | None = None  # the lease this one took over, if any
        self.lost = threading.Event()
        # called (from the renewing thread) once the lease is lost: e.g. leave the broker at
        # once, before a stale coordinator's reconnect knocks its successor (same client id) off
        self.on_lost: list[Callable[[], None]] = []
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    def _mine(self) -> Lease:
        now = utcnow()
        return Lease(self.run_id, self.holder, self.host, self.pid, self.ttl, now, now)

    def acquire(self, wait: float | None = None) -> RunLease:
        """Take the lease (see the module), waiting up to ``wait`` s (default: the ttl and a
        little) for a silent holder's to expire; :class:`RunHeldError` when a live
        coordinator holds it. Starts renewing it and fences the store's writes to the run."""
        limit = self.ttl * 1.2 + 1.0 if wait is None else wait
        started, watched = self._clock(), None
        while not (tried := self._take())[0]:
            held = tried[1]
            if held is not None:  # alive for all it is known (else a claim raced: try again)
                if watched is not None and (held.holder, held.beats) != watched:
                    raise _held(self.run_id, held, "alive: it renewed the lease meanwhile")
                if self._clock() - started >= limit:
                    raise _held(self.run_id, held, f"its lease did not expire in {limit:.0f} s")
                if watched is None:
                    log.warning(
                        "run %s is driven by the coordinator with %s; waiting up to %.0f s to "
                        "see whether it is still alive",
                        self.run_id,
                        held.describe(),
                        limit,
                    )
                watched = (held.holder, held.beats)
            self._sleep(_POLL)
        self.store.fence(self.run_id, self.holder)
        self._thread = threading.Thread(target=self._renew, name="run-lease", daemon=True)
        self._thread.start()
        return self

    def _take(self) -> tuple[bool, Lease | None]:
        """One try at the lease, free or held by a coordinator that is gone: whether it was
        taken, and the holder that kept it when one does not look gone."""
        held = self.store.lease(self.run_id)
        if held is None:
            return self.store.claim_lease(self._mine()), None
        if held.holder == self.holder:
            return True, None
        if not held.gone(self._alive):
            return False, held
        if not self.store.claim_lease(self._mine(), replacing=held):
            return False, None
        self.replaced = held
        log.warning(
            "run %s: took over the lease of a coordinator gone (%s)",
            self.run_id,
            held.describe(),
        )
        return True, None

    def _renew(self) -> None:
        while not self._closed.wait(self.ttl / 3) and self._renew_once():
            pass

    def _renew_once(self) -> bool:
        """Renew the lease; False once it is lost (another coordinator holds it)."""
        try:
            if self.store.renew_lease(self.run_id, self.holder):
                return True
        except Exception as error:  # a store hiccup: the next beat tries again
            log.warning("renewing the lease on run %s: %s", self.run_id, error)
            return True
        self.lost.set()
        for call in self.on_lost:
            try:
                call()
            except Exception as error:  # the run is another's: stop regardless
                log.warning("after losing the lease on run %s: %s", self.run_id, error)
        log.error("%s", lost_error(self.run_id, self.store.lease(self.run_id)))
        return False

    def lost_to(self) -> str | None:
        """Whose the run is when no longer this coordinator's, read now; None while it is
        (asked by its transport before reconnecting: woken from a freeze, the renewal that
        finds the lease lost can come after paho's reconnect)."""
        held = self.store.lease(self.run_id)
        if held is not None and held.holder == self.holder and not self.lost.is_set():
            return None
        other = f"another coordinator's ({held.describe()})" if held else "no coordinator's"
        return f"run {self.run_id} is {other} now"

    def check(self) -> None:
        """Raise :class:`LeaseLostError` once another coordinator took the lease over."""
        if self.lost.is_set():
            raise lost_error(self.run_id, self.store.lease(self.run_id))

    def release(self) -> None:
        """Stop renewing and give the lease up (kept when it was lost: it is another's)."""
        self._closed.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self.store.fence(self.run_id, None)
        if not self.lost.is_set():
            try:
                self.store.release_lease(self.run_id, self.holder)
            except Exception as error:  # it then expires by itself
                log.warning("releasing the lease on run %s: %s", self.run_id, error)

    def __enter__(self) -> RunLease:
        return self.acquire() if self._thread is None else self

    def __exit__(self, *_: object) -> None:
        self.release()


def _held(run_id: str, held: Lease, why: str) -> RunHeldError:
    return RunHeldError(
        f"run {run_id!r} is driven by another coordinator ({held.describe()}; {why}); "
        "stop that one first (`edgesplit runs stop`), or give this one another run id"
    )
