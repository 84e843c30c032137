"""Rows of the ORM schema as the store's records."""

from __future__ import annotations

from datetime import UTC, datetime

from storage.records import DeviceRecord, DeviceResult, RoundRecord, RunRecord, utcnow
from storage.schema import DeviceResultRow, DeviceRow, RoundRow, RunRow

__all__ = ["device_record", "result_record", "round_record", "run_record", "utc"]


def utc(value: datetime | None) -> datetime | None:
    """SQLite returns naive datetimes; every stored time is UTC."""
    if value is None or value.tzinfo is not None:
        return value
    return value.replace(tzinfo=UTC)


def device_record(row: DeviceRow) -> DeviceRecord:
    return DeviceRecord(
        row.name,
        row.kind,
        row.memory_bytes,
        row.flops,
        row.uplink_bytes,
        row.credentials_ref,
        row.status,
        utc(row.last_seen),
    )


def run_record(row: RunRow) -> RunRecord:
    return RunRecord(
        row.id,
        dict(row.config),
        row.status,
        row.seed,
        utc(row.created_at) or utcnow(),
        utc(row.updated_at) or utcnow(),
        row.plan,
        row.plan_version,
        row.current_round,
    )


def result_record(row: DeviceResultRow) -> DeviceResult:
    return DeviceResult(
        row.device,
        row.examples,
        row.loss,
        row.accuracy,
        row.bytes_sent,
        row.bytes_received,
        row.wall_seconds,
        row.peak_memory_bytes,
        row.failure,
    )


def round_record(row: RoundRow) -> RoundRecord:
    results = tuple(sorted((result_record(r) for r in row.results), key=lambda r: r.device))
    return RoundRecord(
        row.run_id,
        row.number,
        row.state,
        tuple(row.participants),
        results,
        dict(row.metrics),
        dict(row.evaluation),
        utc(row.opened_at),
        utc(row.committed_at),
    )
