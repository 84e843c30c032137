"""Checkpoint files a commit is about to write, recorded before they are written.

A commit records each file it will refer to (:func:`mark`) before writing it, and deletes
those rows in the transaction that commits the round; so from the moment a file may exist
until a committed round refers to it, a row protects it. A coordinator killed in between
leaves rows of its run: the run's next coordinator (a run has one writer) removes their files
at once (:func:`discard`), sparing any file a committed round or another run's pending commit
refers to. Rows older than garbage collection's age count as abandoned (:func:`protected`).

Every function runs inside one of the store's write transactions, holding the files lock
(:func:`lock_files`): SQLite's ``BEGIN IMMEDIATE`` is that lock already; PostgreSQL takes a
transaction-scoped advisory lock. Marking, discarding and collecting therefore never
interleave, and a file another commit has marked is never deleted under it.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from sqlalchemy import delete, select, text
from sqlalchemy.orm import Session

from storage.checkpoints import CheckpointFiles
from storage.records import utcnow
from storage.schema import CheckpointRow, PendingCheckpointRow

__all__ = ["discard", "lock_files", "mark", "protected", "settle"]

_FILES_LOCK = 0x65646766  # 'edgf': one key for every edgesplit database's checkpoint files


def lock_files(session: Session) -> None:
    """Hold the checkpoint files' lock until the transaction ends."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": _FILES_LOCK})


def mark(session: Session, run_id: str, digests: Iterable[str]) -> None:
    """Record the files a commit of ``run_id`` is about to write."""
    lock_files(session)
    now = utcnow()
    session.add_all(
        PendingCheckpointRow(run_id=run_id, sha256=d, created_at=now) for d in sorted(set(digests))
    )


def settle(session: Session, run_id: str, digests: Iterable[str]) -> None:
    """The commit that wrote ``digests`` refers to them now: their rows go."""
    session.execute(
        delete(PendingCheckpointRow).where(
            PendingCheckpointRow.run_id == run_id, PendingCheckpointRow.sha256.in_(set(digests))
        )
    )


def protected(session: Session, older_than_seconds: float) -> set[str]:
    """Files a committed round refers to or a commit under way is writing (pending rows
    older than ``older_than_seconds`` are abandoned: deleted, and spare nothing)."""
    lock_files(session)
    cutoff = utcnow() - timedelta(seconds=older_than_seconds)
    session.execute(delete(PendingCheckpointRow).where(PendingCheckpointRow.created_at < cutoff))
    referenced = set(session.scalars(select(CheckpointRow.sha256)))
    return referenced | set(session.scalars(select(PendingCheckpointRow.sha256)))


def discard(session: Session, files: CheckpointFiles, run_id: str) -> int:
    """Remove what ``run_id``'s earlier, killed commits left: their pending rows, and their
    files that no committed round and no other pending commit refers to; how many files."""
    lock_files(session)
    mine = PendingCheckpointRow.run_id == run_id
    digests = set(session.scalars(select(PendingCheckpointRow.sha256).where(mine)))
    if not digests:
        return 0
    session.execute(delete(PendingCheckpointRow).where(mine))
    referenced = select(CheckpointRow.sha256).where(CheckpointRow.sha256.in_(digests))
    others = select(PendingCheckpointRow.sha256).where(PendingCheckpointRow.sha256.in_(digests))
    kept = set(session.scalars(referenced)) | set(session.scalars(others))
    return sum(files.remove(digest) for digest in sorted(digests - kept))
