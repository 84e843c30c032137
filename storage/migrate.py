"""Alembic migrations, run programmatically: ``upgrade(engine)`` brings a database to head.

Opens check the revision first and run alembic only when the database is behind, one at a
time: alembic's context is one global per process (two threads at once failed with
``KeyError: 'script'``), and across processes SQLite's write lock (``BEGIN IMMEDIATE``) or a
PostgreSQL advisory lock (in ``migrations/env.py``) serialises them, and every step of an
upgrade commits together. An open that still finds a table of a migration it runs already
there (a process of an older version, which committed step by step) waits for the other
process to reach head.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Connection, Engine, inspect, text

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = [
    "HEAD",
    "MIGRATIONS",
    "READABLE",
    "alembic_config",
    "current_revision",
    "ensure_current",
    "head",
    "script_head",
    "upgrade",
]

MIGRATIONS = Path(__file__).resolve().parent / "migrations"
# Revisions a read-only open reads as they are: what came after them only added tables that a
# read does without (0002: store_settings; 0003: run_profiles, pending_checkpoints; 0004:
# run_leases, read as "no lease" where absent).
READABLE = frozenset({"0001", "0002", "0003", "0004"})
# The newest revision, known without importing alembic (seconds of a coordinator's restart on
# a loaded machine): an open at head never loads it. tests/unit/test_migrate_head.py checks it.
HEAD = "0004"
_LOCK = threading.Lock()


def alembic_config(engine: Engine) -> Config:
    from alembic.config import Config

    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["engine"] = engine
    return config


def head() -> str:
    """The newest revision this edgesplit knows."""
    return HEAD


def script_head() -> str | None:
    """The newest revision of the migration scripts (what :data:`HEAD` must say)."""
    from alembic.script import ScriptDirectory

    return ScriptDirectory(str(MIGRATIONS)).get_current_head()


def not_a_store(connection: Connection, readonly: bool) -> str | None:
    """Why a database without a revision is no store to open (None: one to create): it
    holds only another program's tables (SQLite: a server's database may be shared; with
    edgesplit's tables another process is creating the store now), or, to read, nothing."""
    from storage.schema import Base

    if connection.dialect.name == "sqlite":
        tables = set(inspect(connection).get_table_names())
        if tables and not tables & set(Base.metadata.tables):
            return "it holds other tables"
    return "no run was ever written to it" if readonly else None


def current_revision(connection: Connection) -> str | None:
    """The database's revision, or None when it has no schema yet."""
    if not inspect(connection).has_table("alembic_version"):
        return None
    return connection.execute(text("SELECT version_num FROM alembic_version")).scalar()


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply all migrations up to ``revision`` (idempotent)."""
    from alembic import command

    with _LOCK:
        command.upgrade(alembic_config(engine), revision)


def ensure_current(engine: Engine, patience: float = 30.0) -> None:
    """Migrate the database unless it is at head already (then nothing is written). When
    the migration finds a table of it already there, another process is migrating the same
    database: wait up to ``patience`` seconds for that one to bring it to head. (Migrations run
    in one transaction now, so edgesplit's own processes no longer meet this; an older
    version's process, which committed step by step, still can.)"""
    from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError

    deadline = time.monotonic() + patience
    while True:
        with engine.connect() as connection:
            current = current_revision(connection)
        if current == head():
            return
        try:
            upgrade(engine)
            return
        except (IntegrityError, OperationalError, ProgrammingError) as error:
            # "already exists": a table the other process committed, or (IntegrityError, a
            # duplicate key in pg_type) one it was creating in a transaction still open then
            if "already exists" not in str(error) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
