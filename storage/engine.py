"""SQLAlchemy engines for the run store, writable or read-only, and one-line opening errors."""

from __future__ import annotations

import contextlib
import os
import re
import sqlite3
import time
from typing import Any
from urllib.parse import quote

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import ArgumentError, DatabaseError, OperationalError
from sqlalchemy.pool import NullPool

from storage.errors import NotAStoreError, StoreError, UnreachableError

__all__ = ["create_store_engine", "database_failure", "opening_error", "shown_url"]

_SQLITE_BUSY_MS = 30_000


def shown_url(url: str | URL) -> str:
    """``url`` as messages show it: the password masked, or only the scheme of a URL that does
    not parse."""
    try:
        return make_url(url).render_as_string(hide_password=True)
    except (ArgumentError, ValueError):
        return f"{str(url).partition('://')[0]}://... (not a valid URL)"


# what SQLite says of a file that is not one of its databases
_NOT_SQLITE = ("file is not a database", "file is encrypted or is not a database")


def opening_error(url: str, error: Exception) -> StoreError:
    """A one-line store error for a database that cannot be opened; the password masked."""
    if not isinstance(error, DatabaseError):
        return StoreError(f"--db {shown_url(url)}: {error}")
    reason = str(error.orig or error).strip().splitlines()[0]
    sqlite = str(url).startswith("sqlite")
    if isinstance(error, OperationalError):
        message = f"cannot open the database at {shown_url(url)}: {reason}{_locked_hint(reason)}"
        if not sqlite and re.search(r'database ".*" does not exist', reason):  # reached
            name = make_url(str(url)).database
            return NotAStoreError(f"{message}; create it first (createdb {name})")
        if not sqlite:  # a server: down, wrong address, login refused
            return UnreachableError(f"{message}; is the database server running and reachable?")
        return StoreError(message)
    if sqlite and reason.startswith(_NOT_SQLITE):  # a file of something else given as --db
        return NotAStoreError(f"--db {shown_url(url)}: not an edgesplit store ({reason})")
    # a failed migration, a permission the database refused: named, a runtime failure
    return StoreError(f"cannot open the store at {shown_url(url)}: {reason}")


def database_failure(url: str, error: DatabaseError) -> StoreError:
    """One line for a database that failed under a command (full, read-only, gone)."""
    reason = str(error.orig or error).strip().splitlines()[0]
    hint = ""
    if "full" in reason or "disk i/o" in reason.lower():
        hint = "; nothing was half-written: free space and run the same command again"
    return StoreError(
        f"the database at {shown_url(url)} failed: {reason}{hint or _locked_hint(reason)}"
    )


def _locked_hint(reason: str) -> str:
    """What to look for when SQLite waited its whole busy timeout for the write lock."""
    if reason != "database is locked":
        return ""
    return (
        f"; another process held its write lock for over {_SQLITE_BUSY_MS // 1000} s: one that "
        "is stopped or frozen (kill -STOP, a suspended host) or a long command; `fuser` on the "
        "file names the processes that have it open"
    )


# A server that vanished without closing the connection (a host gone, a network cut) is
# noticed in seconds, not after the system's TCP timeouts (minutes; a connect to a host that
# drops packets hung for about two): a connect gives up after 10 s, an idle connection is
# probed after 30 s. The URL's own settings (?connect_timeout=...) win.
_SERVER_LINK = {
    "connect_timeout": 10,
    "keepalives": 1,
    "keepalives_idle": 30,
    "keepalives_interval": 10,
    "keepalives_count": 3,
}


def create_store_engine(url: str, password: str | None = None, readonly: bool = False) -> Engine:
    """An engine with the settings the store relies on (SQLite: WAL, foreign keys, busy
    timeout, BEGIN IMMEDIATE so writers queue instead of failing with 'database is locked');
    ``password`` is the database user's when ``url`` holds none. ``readonly`` writes nothing:
    SQLite opens the file with ``mode=ro`` and ``query_only``, PostgreSQL sessions are
    read-only transactions."""
    parsed = make_url(url)
    if parsed.get_backend_name() not in ("sqlite", "postgresql"):
        raise NotAStoreError(
            f"--db {shown_url(url)}: a {parsed.get_backend_name()} database is not supported; "
            "give sqlite:///FILE or postgresql://USER@HOST/DATABASE"
        )
    if parsed.get_backend_name() != "sqlite":
        if password is not None and parsed.password is None:
            parsed = parsed.set(password=password)
        arguments: dict[str, Any] = {k: v for k, v in _SERVER_LINK.items() if k not in parsed.query}
        if readonly:
            arguments["options"] = "-c default_transaction_read_only=on"
        return create_engine(parsed, pool_pre_ping=True, connect_args=arguments)
    database = parsed.database
    if readonly:
        if not database or database == ":memory:":
            raise ValueError("a read-only store needs a database file")
        engine = create_engine(
            "sqlite://", creator=lambda: _read_only_sqlite(database), poolclass=NullPool
        )
    else:
        if database and database != ":memory:" and not os.path.exists(database):
            # the run store holds the run's config and history: its owner's alone (0600;
            # SQLite gives its -wal and -shm files the same mode)
            os.makedirs(os.path.dirname(os.path.abspath(database)), exist_ok=True)
            with contextlib.suppress(FileExistsError):  # another open made it just now
                os.close(os.open(database, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
        engine = create_engine(url, connect_args={"timeout": _SQLITE_BUSY_MS / 1000})
    _configure_sqlite(engine, readonly)
    return engine


def _read_only_sqlite(database: str) -> sqlite3.Connection:
    """A connection that writes nothing, not even SQLite's ``-shm`` index. Without a ``-wal``
    file no writer has the database open (the last one to close removes it) and every commit
    is in the file: ``immutable=1`` reads it without locks or side files. With one, ``mode=ro``
    reads the commits still in the log (creating ``-shm`` if it is missing and the folder
    allows)."""
    address = f"file:{quote(os.path.abspath(database))}?mode=ro"
    if not os.path.exists(f"{database}-wal"):
        address += "&immutable=1"
    return sqlite3.connect(
        address, uri=True, timeout=_SQLITE_BUSY_MS / 1000, check_same_thread=False
    )


def _wal(cursor: Any) -> None:
    """Put the database in WAL mode (once per file; it stays). Switching needs the file to
    itself, and SQLite skips the busy handler when waiting could deadlock (another connection
    inside a write transaction, as a first open migrating): retry until the busy timeout."""
    deadline = time.monotonic() + _SQLITE_BUSY_MS / 1000
    while True:
        try:
            if cursor.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                cursor.execute("PRAGMA journal_mode=WAL")
            return
        except sqlite3.OperationalError as error:
            if "locked" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def _configure_sqlite(engine: Engine, readonly: bool) -> None:
    @event.listens_for(engine, "connect")
    def _configure(dbapi_connection: Any, _record: Any) -> None:
        dbapi_connection.isolation_level = None  # transactions are begun explicitly below
        cursor = dbapi_connection.cursor()
        if readonly:
            cursor.execute("PRAGMA query_only=ON")  # a write raises instead of happening
        else:
            _wal(cursor)
            cursor.execute("PRAGMA synchronous=FULL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute(f"PRAGMA busy_timeout={_SQLITE_BUSY_MS}")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin(connection: Any) -> None:
        connection.exec_driver_sql("BEGIN" if readonly else "BEGIN IMMEDIATE")
