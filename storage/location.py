"""Where a store keeps its checkpoint files: pure rules, no I/O.

A SQLite store keeps them beside its file (``<file>.checkpoints/``) unless told otherwise; a
PostgreSQL store must be told once (``--checkpoints DIR``) and records the folder in the
database, so that ``status``, ``export`` and ``db check`` from any directory find it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from storage.errors import StoreError, UsageError

__all__ = ["CheckpointRoot", "choose_root", "default_root"]


def default_root(url: str) -> Path | None:
    """``<file>.checkpoints`` beside a SQLite file; None for a server database."""
    if url.startswith("sqlite:///") and url != "sqlite:///:memory:":
        database = Path(url.removeprefix("sqlite:///"))
        return database.with_name(database.name + ".checkpoints")
    return None


@dataclass(frozen=True)
class CheckpointRoot:
    """The folder to use (None: unknown), and whether the store should record it."""

    path: Path | None
    record: bool = False


def choose_root(
    explicit: Path | None,
    recorded: Path | None,
    default: Path | None,
    recorded_exists: bool,
    readonly: bool = False,
) -> CheckpointRoot:
    """The checkpoint folder of a store. ``explicit`` (``--checkpoints``) wins; a writable
    open records it when it is not the default. A recorded folder that still exists is not
    replaced by another: that would hide every checkpoint the store has."""
    if explicit is None:
        return CheckpointRoot(recorded or default)
    if readonly or explicit == recorded:
        return CheckpointRoot(explicit)
    if recorded is not None and recorded_exists:
        raise UsageError(
            f"--checkpoints {explicit}: this store keeps its checkpoints in {recorded}; "
            "leave out --checkpoints, or move that folder to the new place first"
        )
    return CheckpointRoot(explicit, record=recorded is not None or explicit != default)


def unknown_root_error(shown: str) -> StoreError:
    """For a server database that has never been told where its checkpoints go."""
    return UsageError(
        f"--checkpoints: the database at {shown} records no checkpoint folder yet; give one "
        "with --checkpoints DIR (a folder every coordinator, status and export of this "
        "database can reach, e.g. a shared volume)"
    )
