"""Alembic environment: runs against the engine passed in ``config.attributes``.

On PostgreSQL a transaction-scoped advisory lock makes concurrent opens migrate one after the
other (the second then finds the schema at head); SQLite's ``BEGIN IMMEDIATE`` does the same.
Every step runs in one transaction, so no other process sees a store between two steps.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import text

from storage.schema import Base

_MIGRATION_LOCK = 0x65646765  # 'edge': one key for every edgesplit database

engine = context.config.attributes["engine"]
# One transaction for every step: alembic commits after each migration on SQLite (DDL counts as
# non-transactional there), which let a second process take the write lock between two steps,
# read the version of the first, and run the second step too ("table run_profiles already
# exists" for the one that had planned it). Begun here, alembic runs inside it.
with engine.connect() as connection, connection.begin():
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
