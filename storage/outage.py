"""Riding through a database server's outage: a restart, a failover, a network blip.

A long-running coordinator on PostgreSQL meets its server down now and then. Without help,
the first store call in the gap failed, the coordinator exited and the round under way was
lost (a restart resumed from the last committed round). Now, up to ``wait`` seconds:

- :class:`ServerWait` waits for the server before a transaction begins (nothing of it has
  run until a connection is made, so trying again is always safe);
- a transaction that loses its connection before its commit is rolled back by the server,
  and the store call that ran it runs again from its start (:func:`rides_outages`);
- one whose commit lost its connection is asked about once the server answers: committed,
  the call returns as if nothing happened; not, it runs again. PostgreSQL says which
  (``txid_status`` of the id the transaction got before its commit); a transaction that only
  read lost nothing either way.

One deadline an outage, for every call and thread: ``wait`` after the outage was first met.
Once a call gave up, or a wait was interrupted (Ctrl-C, SIGTERM), or the store was told to stop
waiting, no call waits again until the server answers: a coordinator stopping records what it
can and exits, instead of waiting again for each call on its way out.

A server that cannot say (none but PostgreSQL has a server here) fails such a commit as before:
the coordinator stops and, run again, resumes.

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

from sqlalchemy import event, text
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
_T = TypeVar("_T")

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

    def __init__(self, error: OperationalError, answers: bool = False) -> None:
        super().__init__(str(error))
        self.error = error
        self.answers = answers  # the server was asked about it since: no outage to wait out


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
        try:
            while True:
                try:
                    return method(self, *args, **kwargs)
                except Disconnected as lost:
                    self._server.retry(lost)
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
        self._given_up = False  # a call of this outage gave up or was interrupted
        self._ended: list[float] = []  # how long each outage ridden through lasted
        self._lock = threading.Lock()
        # a commit of writes lost on the way is asked about where the server can say
        self._xids = engine is not None and wait > 0 and engine.dialect.name == "postgresql"
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
        xid = None
        try:
            try:
                yield session
                session.flush()  # its writes sent: a failure up to here lost nothing
                if self._xids and marks.get(_WROTE):  # to ask, if its commit is lost, if kept
                    xid = session.execute(text("SELECT txid_current()")).scalar()
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
                wrote = bool(marks.get(_WROTE, True))
                if wrote and xid is not None and server_unreachable(error):
                    if self._kept(sessions, int(xid), error):
                        return  # the server committed it; only its answer was lost
                    raise Disconnected(error, answers=True) from error
                if lost := self._lost(error, committing=wrote):
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

    def _kept(self, sessions: sessionmaker[Session], xid: int, error: OperationalError) -> bool:
        """Whether the transaction ``xid``, whose commit lost its connection, was committed:
        asked of the server once it answers (PostgreSQL's ``txid_status``)."""
        since = self._met(self._clock(), error)
        while True:
            probe = self._connect(sessions)
            try:
                status = probe.execute(text("SELECT txid_status(:x)"), {"x": xid}).scalar()
            except OperationalError as again:
                if not server_unreachable(again):
                    raise
                self._pause(since, again, _FIRST_DELAY)
                continue
            finally:
                probe.close()
            if status != "in progress":  # its backend has not yet seen the connection go
                kept = status == "committed"
                log.info(
                    "a commit whose answer was lost was %s by the server at %s",
                    "kept" if kept else f"not kept ({status}): its call runs again",
                    self.shown,
                )
                return kept
            self._pause(since, error, _FIRST_DELAY)

    def opening(self, check: Callable[[], None]) -> None:
        """Run ``check`` (a store's first use of its engine), waiting for an unreachable
        server as a transaction does; past the wait its own error is raised (the open's)."""
        self._answered(check, own_error=True)

    def retry(self, lost: Disconnected) -> None:
        """A transaction lost its connection before it committed: wait a moment before the
        call runs again; :class:`~storage.errors.UnreachableError` once the outage is past
        the wait. One the server was asked about runs again at once: waiting would be a
        second outage, said and recorded, after the one that ended when it answered."""
        if not lost.answers:
            self._pause(self._met(self._clock(), lost.error), lost.error, _FIRST_DELAY)

    def _connect(self, sessions: sessionmaker[Session]) -> Session:
        def connected() -> Session:
            session = sessions()
            try:
                session.connection()  # begins the transaction on a live connection
            except OperationalError:
                session.close()
                raise
            return session

        return self._answered(connected)

    def _answered(self, call: Callable[[], _T], own_error: bool = False) -> _T:
        """``call()``, run again while the server does not answer, with a growing pause
        (:meth:`_pause`), until the outage wait is spent: then
        :class:`~storage.errors.UnreachableError`, or with ``own_error`` the call's own."""
        delay = _FIRST_DELAY
        while True:
            try:
                result = call()
            except OperationalError as error:
                if self.wait <= 0 or not server_unreachable(error):
                    raise
                since = self._met(self._clock(), error)
                if own_error and self._clock() - since >= self.wait:
                    raise
                self._pause(since, error, delay)
                delay = min(delay * 2, _MAX_DELAY)
                continue
            if self._since is not None:
                self._over()
            return result

    def _pause(self, since: float, error: OperationalError, delay: float) -> None:
        """Sleep ``delay`` (at most to the outage's deadline, one for every call and thread:
        ``wait`` after the outage was first met). Past it, or once a call gave up or was
        interrupted (Ctrl-C, SIGTERM) in this outage, raise at once: a coordinator stopping
        records what it can and exits, instead of waiting again for every call on its way."""
        now = self._clock()
        if self._given_up or now - since >= self.wait:
            cut = self._given_up and now - since < self.wait  # a stop, not the wait spent
            self._given_up = True
            wait = "not waited for: stopping" if cut else f"--db-outage-wait {self.wait:.0f} s"
            raise UnreachableError(
                f"the database at {self.shown} has not answered for {now - since:.0f} s "
                f"({wait}): {_reason(error)}"
            ) from None
        try:
            self._sleep(min(delay, since + self.wait - now))
        except BaseException:
            self._given_up = True
            raise

    def _met(self, now: float, error: OperationalError) -> float:
        """When the outage under way began (now, for the first call to meet it: said)."""
        with self._lock:
            if self._since is not None:
                return self._since
            self._since = now
        log.warning(
            "the database at %s does not answer (%s); waiting up to %.0f s for it "
            "(--db-outage-wait)",
            self.shown,
            _reason(error),
            self.wait,
        )
        return now

    def stop(self) -> None:
        """Wait no more in this outage, or the next (:meth:`RunStore.stop_waiting`): an
        unreachable server is an :class:`~storage.errors.UnreachableError` at once."""
        self._given_up = True

    def _over(self) -> None:
        with self._lock:
            since, self._since, self._given_up = self._since, None, False
            if since is not None:
                self._ended.append(self._clock() - since)
        if since is not None:
            log.warning(
                "the database at %s answers again after %.1f s",
                self.shown,
                self._clock() - since,
            )

    def take_ended(self) -> list[float]:
        """How long each outage that ended since the last call lasted (seconds)."""
        with self._lock:
            ended, self._ended = self._ended, []
        return ended
