"""Exceptions of the run store."""

from __future__ import annotations

__all__ = [
    "CheckpointError",
    "CheckpointWriteError",
    "NotAStoreError",
    "NotFoundError",
    "StateError",
    "StoreError",
    "UnreachableError",
    "UsageError",
]


class StoreError(Exception):
    """Base class for run-store errors."""


class NotFoundError(StoreError, KeyError):
    """A run, round, device or checkpoint that was asked for does not exist."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "not found"


class NotAStoreError(StoreError):
    """The database named is not a run store (a file of something else): a usage error."""


class UsageError(StoreError):
    """What the command was given does not fit the store (``--checkpoints`` missing for a
    server database, or naming another folder than the one recorded): a usage error."""


class StateError(StoreError):
    """An operation does not fit the current state (e.g. committing a committed round)."""


class CheckpointError(StoreError):
    """A checkpoint file is missing, truncated or does not match its recorded hash."""


class UnreachableError(StoreError):
    """The database server cannot be reached (down, wrong host or port, refused login)."""


class CheckpointWriteError(StoreError):
    """A checkpoint could not be written (no space, an I/O error): nothing was committed, no
    partial file is left, and the same command can run again once the cause is fixed."""
