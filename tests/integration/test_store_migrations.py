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
