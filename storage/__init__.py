"""Run state of edgesplit: devices, runs, plans, rounds, checkpoints, metrics and events.

``open_store(url)`` picks the backend: ``memory://`` (in-process, nothing persisted), a SQLite
file (``sqlite:///runs.db`` or a plain path, the default) or PostgreSQL
(``postgresql+psycopg://user@host/db``, the password given apart so that it is in no URL that
is printed or passed on a command line). Checkpoint tensors are safetensors files in a
content-addressed directory: beside a SQLite file unless ``checkpoint_dir`` says otherwise; a
PostgreSQL store is told once and records the folder (:mod:`storage.location`). ``readonly``
opens write nothing: no migration, no pragma that writes, no garbage collection.
"""

from __future__ import annotations

from pathlib import Path

from storage.base import RunStore
from storage.errors import (
    CheckpointError,
    CheckpointWriteError,
    NotFoundError,
    StateError,
    StoreError,
)
from storage.lease import Lease, LeaseLostError
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
    "MEMORY_URLS",
    "CheckpointError",
    "CheckpointRef",
    "CheckpointWriteError",
    "DeviceRecord",
    "DeviceResult",
    "Event",
    "InMemoryRunStore",
    "Lease",
    "LeaseLostError",
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
    "sqlite_file",
]


def normalise_url(url: str) -> str:
    """Accept a plain file path as a SQLite database."""
    if "://" in url:
        return url
    return f"sqlite:///{Path(url).expanduser().resolve()}"


MEMORY_URLS = ("memory://", "memory")  # the in-memory store (tests, trials)


def sqlite_file(url: str) -> Path | None:
    """The file a store URL or plain path names when it is a SQLite file, else None (the
    in-memory store, PostgreSQL)."""
    if url in MEMORY_URLS:
        return None
    url = normalise_url(url)
    return Path(url.removeprefix("sqlite:///")) if url.startswith("sqlite:///") else None


def open_store(
    url: str,
    checkpoint_dir: str | Path | None = None,
    password: str | None = None,
    readonly: bool = False,
    outage_wait: float = 0.0,
) -> RunStore:
    """Open (and, unless ``readonly``, migrate) the store at ``url``; ``password`` is the
    database user's when the URL holds none (ignored for SQLite and memory). ``outage_wait``:
    seconds each transaction waits for an unreachable database server (:mod:`storage.outage`;
    0 fails at once, as a command should; a coordinator rides through a restart)."""
    if url in MEMORY_URLS:
        return InMemoryRunStore()
    from storage.sql import SqlRunStore

    folder = sqlite_file(url)
    if folder is not None and folder.is_dir():  # SQLite says only "disk I/O error"
        inside = folder / "runs.db"
        hint = f": give the file, {inside}" if inside.is_file() else ": give the database file"
        raise StoreError(f"{folder} is a folder, not a SQLite database{hint}")
    return SqlRunStore(
        normalise_url(url),
        checkpoint_dir,
        password=password,
        readonly=readonly,
        outage_wait=outage_wait,
    )
