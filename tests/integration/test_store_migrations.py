"""Migrations produce exactly the ORM's schema, on SQLite and PostgreSQL."""

from __future__ import annotations

from pathlib import Path

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from sqlalchemy import inspect

from storage.migrate import upgrade
from storage.schema import Base
from storage.sql import create_store_engine

pytestmark = pytest.mark.integration


def _differences(url: str) -> list[object]:
    engine = create_store_engine(url)
    try:
        upgrade(engine)
        upgrade(engine)  # idempotent
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            tables = set(inspect(connection).get_table_names())
            assert set(Base.metadata.tables) <= tables
            return list(compare_metadata(context, Base.metadata))
    finally:
        engine.dispose()


def test_sqlite_migrations_match_orm(tmp_path: Path) -> None:
    assert _differences(f"sqlite:///{tmp_path / 'm.db'}") == []


def test_postgres_migrations_match_orm(postgres_url: str) -> None:
    assert _differences(postgres_url) == []


def _half_made(url: str) -> None:
    """What an open sees while another process migrates: the tables, no version yet; the
    other process stamps it a second later."""
    import threading
    import time

    from sqlalchemy import text

    from storage import open_store
    from storage.migrate import current_revision, head

    engine = create_store_engine(url)
    Base.metadata.create_all(engine)

    def stamp() -> None:
        time.sleep(1.0)
        with engine.begin() as connection:
            connection.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32))"))
            connection.execute(text("INSERT INTO alembic_version VALUES (:v)"), {"v": head()})

    other = threading.Thread(target=stamp)
    other.start()
    try:
        with open_store(url) as store:
            assert store.list_runs() == []
    finally:
        other.join()
    with engine.connect() as connection:
        assert current_revision(connection) == head()
    engine.dispose()


def test_an_open_during_another_migration_waits_for_it_on_sqlite(tmp_path: Path) -> None:
    _half_made(f"sqlite:///{tmp_path / 'm.db'}")


def test_an_open_during_another_migration_waits_for_it_on_postgres(postgres_url: str) -> None:
    _half_made(postgres_url)


def _commits_of_an_upgrade(url: str) -> int:
    from sqlalchemy import event

    engine = create_store_engine(url)
    commits = []
    event.listen(engine, "commit", lambda _connection: commits.append(1))
    try:
        upgrade(engine)
        with engine.connect() as connection:
            assert set(Base.metadata.tables) <= set(inspect(connection).get_table_names())
    finally:
        engine.dispose()
    return len(commits)


def test_every_migration_step_commits_together_on_sqlite(tmp_path: Path) -> None:
    # A commit between two steps let a second process run the later step again ("table
    # run_profiles already exists"): the upgrade from nothing is one transaction.
    assert _commits_of_an_upgrade(f"sqlite:///{tmp_path / 'm.db'}") == 1


def test_every_migration_step_commits_together_on_postgres(postgres_url: str) -> None:
    assert _commits_of_an_upgrade(postgres_url) == 1


def test_an_open_that_meets_a_version_table_being_created_on_postgres_waits(
    postgres_url: str,
) -> None:
    # Another process's CREATE TABLE alembic_version, still uncommitted, makes the open's own
    # one wait; once the other commits, PostgreSQL fails the open's with a duplicate key in
    # pg_type, not "already exists" (CI, stop 44). The open must wait for head all the same.
    import threading

    from sqlalchemy import text

    from storage.migrate import current_revision, ensure_current, head

    engine = create_store_engine(postgres_url)
    Base.metadata.create_all(engine)
    failures: list[BaseException] = []

    def open_it() -> None:
        try:
            ensure_current(engine, patience=20.0)
        except BaseException as error:  # reported below, in the test's thread
            failures.append(error)

    with engine.connect() as other:
        transaction = other.begin()
        other.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32))"))
        opening = threading.Thread(target=open_it)
        opening.start()
        _until_a_session_waits_on_a_lock(engine)  # the open, on the other's uncommitted table
        other.execute(text("INSERT INTO alembic_version VALUES (:v)"), {"v": head()})
        transaction.commit()
    opening.join(timeout=30)
    assert not opening.is_alive()
    assert failures == []
    with engine.connect() as connection:
        assert current_revision(connection) == head()
    engine.dispose()


def _until_a_session_waits_on_a_lock(engine: object, patience: float = 20.0) -> None:
    import time

    from sqlalchemy import text

    query = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        with engine.connect() as connection:  # type: ignore[attr-defined]
            if connection.execute(query).scalar():
                return
        time.sleep(0.05)
    raise AssertionError(f"no session waited on a lock within {patience} s")
