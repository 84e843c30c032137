"""Leases on runs: at most one coordinator drives a run.

A coordinator claims its run's lease before it touches the broker or the run, renews it every
few seconds and releases it when it ends. Every change of a lease is a compare-and-swap on
``(holder, beats)``, and a store a coordinator fenced (:meth:`~storage.base.RunStore.fence`)
renews the lease in the transaction of every write to the run (a round opened, results, a
commit, an event, the status): a coordinator whose lease was taken over cannot write to the
run, even before it knows (the lease is a fencing token). Who may take a lease over, and when,
is the coordinator's policy (:mod:`coordinator.lease`); the store only keeps the row.

Times are each holder's own clock (UTC): hosts whose clocks differ by more than a lease's
``ttl`` may take a lease over early or late.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import delete, inspect, select, update
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from storage.errors import StateError
from storage.records import utcnow
from storage.rows import utc
from storage.schema import RunLeaseRow

__all__ = [
    "Lease",
    "LeaseLostError",
    "SqlLeases",
    "fence_in",
    "lease_in",
    "lost_error",
    "process_alive",
    "renew_in",
]


def process_alive(pid: int) -> bool:
    """Whether a process ``pid`` exists on this host (one of another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's (PermissionError), or cannot tell: assume alive, the
        return True  # lease then expires by time
    return True


class LeaseLostError(StateError):
    """Another coordinator holds the run's lease now; this one must stop without committing."""


@dataclass(frozen=True)
class Lease:
    """Who drives ``run_id``: ``holder`` is a random token per coordinator, ``beats`` counts
    its renewals (the compare-and-swap's version)."""

    run_id: str
    holder: str
    host: str
    pid: int
    ttl: float
    acquired_at: datetime
    renewed_at: datetime
    beats: int = 0

    def age(self, now: datetime | None = None) -> float:
        """Seconds since the last renewal."""
        return ((now or utcnow()) - self.renewed_at).total_seconds()

    def expired(self, now: datetime | None = None) -> bool:
        return self.age(now) > self.ttl

    def gone(self, alive: Callable[[int], bool] = process_alive) -> bool:
        """Whether the holder is known to be gone: its lease expired, or it ran on this host
        (in another process) and its process no longer exists."""
        if self.expired():
            return True
        here = self.host == socket.gethostname() and self.pid != os.getpid()
        return here and not alive(self.pid)

    def describe(self, now: datetime | None = None) -> str:
        """``pid 4242 on host-a, renewed 3 s ago``."""
        return f"pid {self.pid} on {self.host}, renewed {max(self.age(now), 0.0):.0f} s ago"


def lost_error(run_id: str, holder: Lease | None) -> LeaseLostError:
    now = f"; it is held by the coordinator with {holder.describe()}" if holder else ""
    return LeaseLostError(
        f"run {run_id!r}: this coordinator's lease was taken over{now}; it stops without committing"
    )


def _record(row: RunLeaseRow) -> Lease:
    return Lease(
        row.run_id,
        row.holder,
        row.host,
        row.pid,
        row.ttl_seconds,
        utc(row.acquired_at) or utcnow(),
        utc(row.renewed_at) or utcnow(),
        row.beats,
    )


def _has_leases(session: Session) -> bool:
    """False on a store from before leases (0003), opened read-only as it is."""
    return inspect(session.connection()).has_table(RunLeaseRow.__tablename__)


def lease_in(session: Session, run_id: str) -> Lease | None:
    """``run_id``'s lease as ``session`` reads it (None without one)."""
    if not _has_leases(session):
        return None
    row = session.get(RunLeaseRow, run_id)
    return None if row is None else _record(row)


def renew_in(session: Session, run_id: str, holder: str) -> bool:
    """Renew ``holder``'s lease inside ``session``'s transaction; False when it holds none."""
    changed = session.execute(
        update(RunLeaseRow)
        .where(RunLeaseRow.run_id == run_id, RunLeaseRow.holder == holder)
        .values(renewed_at=utcnow(), beats=RunLeaseRow.beats + 1)
        .execution_options(synchronize_session=False)
    )
    return bool(getattr(changed, "rowcount", 0))


def fence_in(session: Session, run_id: str, holder: str) -> None:
    """Renew ``holder``'s lease on ``run_id`` inside ``session``'s transaction, or raise
    :class:`LeaseLostError` (the transaction then writes nothing)."""
    if not renew_in(session, run_id, holder):
        raise lost_error(run_id, lease_in(session, run_id))


class SqlLeases:
    """The lease operations of :class:`storage.sql.SqlRunStore` (a mixin over its sessions)."""

    def _session(self, fence: str | None = None) -> AbstractContextManager[Session]:
        raise NotImplementedError  # SqlRunStore's transactions

    def lease(self, run_id: str) -> Lease | None:
        with self._session() as session:
            return lease_in(session, run_id)

    def claim_lease(self, lease: Lease, replacing: Lease | None = None) -> bool:
        """Take ``run_id``'s lease for ``lease.holder``: a new row when ``replacing`` is None,
        else only if the row is still ``replacing`` (same holder, same beats)."""
        try:
            with self._session() as session:
                if replacing is None:
                    session.add(RunLeaseRow(run_id=lease.run_id, **_columns(lease, lease.beats)))
                    session.flush()
                    return True
                changed = session.execute(
                    update(RunLeaseRow)
                    .where(
                        RunLeaseRow.run_id == lease.run_id,
                        RunLeaseRow.holder == replacing.holder,
                        RunLeaseRow.beats == replacing.beats,
                    )
                    .values(**_columns(lease, replacing.beats + 1))
                    .execution_options(synchronize_session=False)
                )
                return bool(getattr(changed, "rowcount", 0))
        except IntegrityError:  # another coordinator inserted the row first
            return False

    def renew_lease(self, run_id: str, holder: str) -> bool:
        with self._session() as session:
            return renew_in(session, run_id, holder)

    def release_lease(self, run_id: str, holder: str) -> None:
        with self._session() as session:
            session.execute(
                delete(RunLeaseRow).where(
                    RunLeaseRow.run_id == run_id, RunLeaseRow.holder == holder
                )
            )

    def list_leases(self) -> list[Lease]:
        with self._session() as session:
            if not _has_leases(session):
                return []
            return [_record(r) for r in session.scalars(select(RunLeaseRow))]


def _columns(lease: Lease, beats: int) -> dict[str, object]:
    """The row's columns but its key, from ``lease``, at ``beats`` renewals."""
    return {
        "holder": lease.holder,
        "host": lease.host,
        "pid": lease.pid,
        "ttl_seconds": lease.ttl,
        "acquired_at": lease.acquired_at,
        "renewed_at": lease.renewed_at,
        "beats": beats,
    }
