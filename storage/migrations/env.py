"""Alembic environment: runs against the engine passed in ``config.attributes``.

On PostgreSQL a transaction-scoped advisory lock makes concurrent opens migrate one after the
other (the second then finds the schema at head); SQLite's ``BEGIN IMMEDIATE`` does the same.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from storage.schema import Base

_MIGRATION_LOCK = 0x65646765  # 'edge': one key for every edgesplit database

engine = context.config.attributes["engine"]
with engine.connect() as connection:
    if connection.dialect.name == "postgresql":
        connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _MIGRATION_LOCK})
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
