"""Riding through a database server's outage: a restart, a failover, a network blip.

A long-running coordinator on PostgreSQL meets its server down now and then. Without help,
the first store call in the gap failed, the coordinator exited and the round under way was
lost (a restart resumed from the last committed round). Now, up to ``wait`` seconds:

- :class:`ServerWait` waits for the server before a transaction begins (nothing of it has
  run until a connection is made, so trying again is always safe);
- a transaction that loses its connection before its commit (or at the commit, when it
  wrote nothing) is rolled back by the server, and the store call that ran it runs again
  from its start (:func:`rides_outages`).

What it does not cover: a connection lost while a transaction that wrote commits. Whether the
server kept the commit is unknown, so it fails as before (a window of one round trip); the
coordinator stops and, run again, resumes.

Only failures to reach the server are waited out: a refused password or a database that does
not exist fail at once. SQLite has no server and never waits.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

from sqlalchemy import event
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from storage.errors import UnreachableError

__all__ = [
    "DEFAULT_OUTAGE_WAIT",
    "Disconnected",
    "ServerWait",
    "rides_outages",
    "server_unreachable",
]

log = logging.getLogger(__name__)

_Store = TypeVar("_Store")

DEFAULT_OUTAGE_WAIT = 120.0  # seconds a coordinator waits for its database server

_FIRST_DELAY, _MAX_DELAY = 0.25, 5.0

# psycopg's words for a server that is not there (yet): refused, gone, timed out, starting,
# stopping, recovering, or closing the connection under the client
_UNREACHABLE = re.compile(
    r"connection refused|could not connect|connection (failed|timed out|is bad)|timeout expired"
    r"|server closed the connection|connection to server .* failed|no route to host"
    r"|network is unreachable|the database system is (starting up|shutting down|in recovery"
    r"|not yet accepting)|terminating connection|consuming input failed|ssl syscall error"
    r"|eof detected|broken pipe|connection reset|could not receive data|could not send data"
    r"|too many clients|remaining connection slots",
    re.IGNORECASE,
)
# what waiting cannot fix
_REFUSED = re.compile(
    r"password authentication failed|no password supplied|does not exist|permission denied"
    r"|no pg_hba.conf entry|role .* is not permitted",
    re.IGNORECASE,
)


def server_unreachable(error: OperationalError) -> bool:
    """Whether ``error`` says the server could not be reached (worth waiting for), not that
    it answered with a refusal."""
    reason = str(error.orig or error)
    if _REFUSED.search(reason):
        return False
    return bool(error.connection_invalidated or _UNREACHABLE.search(reason))


def _reason(error: OperationalError) -> str:
    lines = str(error.orig or error).strip().splitlines()
    return lines[0] if lines else type(error.orig or error).__name__


class Disconnected(Exception):
    """A transaction lost its connection before its commit: nothing of it happened, so the
    store call that ran it may run again (:func:`rides_outages`)."""

    def __init__(self, error: OperationalError) -> None:
        super().__init__(str(error))
        self.error = error


_WROTE = "edgesplit_wrote"  # in a connection's info: its transaction sent a write


def _note_write(connection: Connection, _cursor: Any, statement: str, *_: Any, **__: Any) -> None:
    if not statement.lstrip()[:6].upper().startswith(("SELECT", "SHOW")):
        connection.info[_WROTE] = True


_calls = threading.local()  # how deep this thread is in store calls: only the outermost retries


def rides_outages(cls: type[_Store]) -> type[_Store]:
    """Wrap each public method of a store class so that a call whose transaction lost its
    connection before committing runs again, from its start, once the server answers. Every
    method of the store may run again: a call is one transaction, or transactions that are
    each safe to repeat (a commit's pending marks; files named by their content)."""
    for name in dir(cls):
        method = getattr(cls, name)
        if name.startswith("_") or not inspect.isfunction(method):
            continue
        setattr(cls, name, _riding(method))
    return cls


def _riding(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if getattr(_calls, "depth", 0):  # inside another store call: that one runs again
            return method(self, *args, **kwargs)
        _calls.depth = 1
        began: float | None = None
        try:
            while True:
                try:
                    return method(self, *args, **kwargs)
                except Disconnected as lost:
                    began = self._server.retry(began, lost)
        finally:
            _calls.depth = 0

    return call


class ServerWait:
    """Waits for a store's database server; one warning an outage, however many threads
    meet it (the coordinator's rounds, its lease, its stop watch)."""

    def __init__(
        self,
        shown: str,
        wait: float,
        engine: Engine | None = None,
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``engine``: the store's; its statements are watched for writes, so that a
        transaction that wrote nothing and lost its connection at its commit runs again."""
        self.shown, self.wait, self._sleep, self._clock = shown, wait, sleep, clock
        self._since: float | None = None  # when the outage under way was first met
        self._lock = threading.Lock()
        if engine is not None and wait > 0:
            event.listen(engine, "before_cursor_execute", _note_write)

    @contextmanager
    def session(self, sessions: sessionmaker[Session]) -> Iterator[Session]:
        """A transaction, committed when the block ends without an exception and rolled
        back otherwise, like ``sessions.begin()``; its connection is made first, waiting
        for an unreachable server up to :attr:`wait` seconds (0: not at all)."""
        session = self._connect(sessions)
        marks = session.connection().info
        marks[_WROTE] = False
        try:
            try:
                yield session
                session.flush()  # its writes sent: a failure up to here lost nothing
            except OperationalError as error:
                with contextlib.suppress(Exception):
                    session.rollback()
                if lost := self._lost(error, committing=False):
                    raise lost from error
                raise
            except BaseException:
                session.rollback()
                raise
            try:
                session.commit()
            except OperationalError as error:
                if lost := self._lost(error, committing=bool(marks.get(_WROTE, True))):
                    raise lost from error
                raise
        finally:
            session.close()

    def _lost(self, error: OperationalError, committing: bool) -> Disconnected | None:
        """:class:`Disconnected` (the call runs again) for a transaction that failed with
        ``error`` when the server went away before anything of it could be kept; None for a
        commit of writes lost on the way (whether the server kept it is unknown)."""
        if self.wait > 0 and not committing and server_unreachable(error):
            return Disconnected(error)
        return None

    def retry(self, began: float | None, lost: Disconnected) -> float:
        """A transaction lost its connection before it committed: when the call began to
        be retried; :class:`~storage.errors.UnreachableError` once that is ``wait`` ago."""
        now = self._clock()
        began = now if began is None else began
        self._met(now, lost.error)
        if now - began >= self.wait:
            raise UnreachableError(
                f"the database at {self.shown} kept closing the connection for "
                f"{self.wait:.0f} s ({_reason(lost.error)}); run the same command again "
                "once it is back"
            ) from None
        self._sleep(_FIRST_DELAY)  # a server closing every connection is not asked in a loop
        return began

    def _connect(self, sessions: sessionmaker[Session]) -> Session:
        began: float | None = None
        delay = _FIRST_DELAY
        while True:
            session = sessions()
            try:
                session.connection()  # begins the transaction on a live connection
            except OperationalError as error:
                session.close()
                if self.wait <= 0 or not server_unreachable(error):
                    raise
                now = self._clock()
                began = now if began is None else began
                self._met(now, error)
                if now - began >= self.wait:
                    raise UnreachableError(
                        f"the database at {self.shown} did not answer for {self.wait:.0f} s "
                        f"({_reason(error)}); run the same command again once it is back"
                    ) from None
                self._sleep(min(delay, began + self.wait - now))
                delay = min(delay * 2, _MAX_DELAY)
                continue
            if began is not None or self._since is not None:
                self._over()
            return session

    def _met(self, now: float, error: OperationalError) -> None:
        with self._lock:
            if self._since is not None:
                return
            self._since = now
        log.warning(
            "the database at %s does not answer (%s); waiting up to %.0f s for it",
            self.shown,
            _reason(error),
            self.wait,
        )

    def _over(self) -> None:
        with self._lock:
            since, self._since = self._since, None
        if since is not None:
            log.warning(
                "the database at %s answers again after %.1f s",
                self.shown,
                self._clock() - since,
            )
