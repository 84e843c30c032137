"""Run state of edgesplit: devices, runs, plans, rounds, checkpoints, metrics and events.

``open_store(url)`` picks the backend: ``memory://`` (in-process, nothing persisted), a SQLite
file (``sqlite:///runs.db`` or a plain path, the default) or PostgreSQL
(``postgresql+psycopg://user@host/db``, the password given apart so that it is in no URL that
is printed or passed on a command line). Checkpoint tensors are safetensors files in a
content-addressed directory next to the database unless ``checkpoint_dir`` says otherwise.
"""

from __future__ import annotations

from pathlib import Path

from storage.base import RunStore
from storage.errors import CheckpointError, NotFoundError, StateError, StoreError
from storage.memory import InMemoryRunStore
from storage.records import (
    CheckpointRef,
    DeviceRecord,
    DeviceResult,
    Event,
    MetricPoint,
    ResumeState,
    RoundRecord,
    RunRecord,
)

__all__ = [
    "CheckpointError",
    "CheckpointRef",
    "DeviceRecord",
    "DeviceResult",
    "Event",
    "InMemoryRunStore",
    "MetricPoint",
    "NotFoundError",
    "ResumeState",
    "RoundRecord",
    "RunRecord",
    "RunStore",
    "StateError",
    "StoreError",
    "normalise_url",
    "open_store",
]


def normalise_url(url: str) -> str:
    """Accept a plain file path as a SQLite database."""
    if "://" in url:
        return url
    return f"sqlite:///{Path(url).expanduser().resolve()}"


def _default_checkpoint_dir(url: str) -> Path:
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        database = Path(url.removeprefix("sqlite:///"))
        return database.with_name(database.name + ".checkpoints")
    return Path("checkpoints")


def open_store(
    url: str, checkpoint_dir: str | Path | None = None, password: str | None = None
) -> RunStore:
    """Open (and migrate) the store at ``url``; ``password`` is the database user's when the
    URL holds none (ignored for SQLite and memory)."""
    if url in ("memory://", "memory"):
        return InMemoryRunStore()
    from storage.sql import SqlRunStore

    url = normalise_url(url)
    return SqlRunStore(url, checkpoint_dir or _default_checkpoint_dir(url), password=password)
