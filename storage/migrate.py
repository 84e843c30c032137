"""Alembic migrations, run programmatically: ``upgrade(engine)`` brings a database to head."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from sqlalchemy import Engine

__all__ = ["MIGRATIONS", "alembic_config", "upgrade"]

MIGRATIONS = Path(__file__).resolve().parent / "migrations"


def alembic_config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["engine"] = engine
    return config


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Apply all migrations up to ``revision`` (idempotent)."""
    command.upgrade(alembic_config(engine), revision)
