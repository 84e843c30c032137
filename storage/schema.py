"""The ORM schema (SQLAlchemy 2, typed). Alembic migrations in ``storage/migrations`` must
produce exactly this schema; a test compares them."""

from __future__ import annotations

from datetime import datetime
from typing import Any, ClassVar

from sqlalchemy import (
    JSON,
    BigInteger,
    DateTime,
    Float,
    ForeignKey,
    Integer,
    MetaData,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

__all__ = [
    "Base",
    "CheckpointRow",
    "DeviceResultRow",
    "DeviceRow",
    "EventRow",
    "MetricRow",
    "PendingCheckpointRow",
    "RoundRow",
    "RunLeaseRow",
    "RunProfileRow",
    "RunRow",
    "StoreSettingRow",
]

_NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=_NAMING)
    type_annotation_map: ClassVar[dict[Any, Any]] = {
        datetime: DateTime(timezone=True),
        dict[str, Any]: JSON,
    }


class DeviceRow(Base):
    __tablename__ = "devices"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(128), unique=True)
    kind: Mapped[str] = mapped_column(String(16))
    memory_bytes: Mapped[int] = mapped_column(BigInteger)
    flops: Mapped[float] = mapped_column(Float)
    uplink_bytes: Mapped[float | None] = mapped_column(Float)
    credentials_ref: Mapped[str | None] = mapped_column(String(256))
    status: Mapped[str] = mapped_column(String(16))
    last_seen: Mapped[datetime | None]


class RunRow(Base):
    __tablename__ = "runs"
    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    config: Mapped[dict[str, Any]]
    status: Mapped[str] = mapped_column(String(16))
    seed: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[datetime]
    updated_at: Mapped[datetime]
    plan: Mapped[dict[str, Any] | None]
    plan_version: Mapped[int] = mapped_column(Integer)
    current_round: Mapped[int | None] = mapped_column(Integer)
    rounds: Mapped[list[RoundRow]] = relationship(back_populates="run", cascade="all")


class RoundRow(Base):
    __tablename__ = "rounds"
    __table_args__ = (UniqueConstraint("run_id", "number", name="uq_rounds_run_id_number"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    number: Mapped[int] = mapped_column(Integer)
    state: Mapped[str] = mapped_column(String(16))
    participants: Mapped[list[str]] = mapped_column(JSON)
    metrics: Mapped[dict[str, Any]]
    evaluation: Mapped[dict[str, Any]]
    opened_at: Mapped[datetime]
    committed_at: Mapped[datetime | None]
    run: Mapped[RunRow] = relationship(back_populates="rounds")
    results: Mapped[list[DeviceResultRow]] = relationship(cascade="all, delete-orphan")
    checkpoints: Mapped[list[CheckpointRow]] = relationship(cascade="all, delete-orphan")


class DeviceResultRow(Base):
    __tablename__ = "device_results"
    __table_args__ = (
        UniqueConstraint("round_id", "device", name="uq_device_results_round_id_device"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id", ondelete="CASCADE"))
    device: Mapped[str] = mapped_column(String(128))
    examples: Mapped[int] = mapped_column(BigInteger)
    loss: Mapped[float | None] = mapped_column(Float)
    accuracy: Mapped[float | None] = mapped_column(Float)
    bytes_sent: Mapped[int] = mapped_column(BigInteger)
    bytes_received: Mapped[int] = mapped_column(BigInteger)
    wall_seconds: Mapped[float] = mapped_column(Float)
    peak_memory_bytes: Mapped[int | None] = mapped_column(BigInteger)
    failure: Mapped[str | None] = mapped_column(Text)


class CheckpointRow(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (
        UniqueConstraint("round_id", "segment", "kind", name="uq_checkpoints_round_segment_kind"),
    )
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    round_id: Mapped[int] = mapped_column(ForeignKey("rounds.id", ondelete="CASCADE"))
    segment: Mapped[str] = mapped_column(String(128))
    kind: Mapped[str] = mapped_column(String(16))
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    size_bytes: Mapped[int] = mapped_column(BigInteger)


class MetricRow(Base):
    __tablename__ = "metrics"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), index=True)
    round: Mapped[int | None] = mapped_column(Integer)
    device: Mapped[str | None] = mapped_column(String(128))
    name: Mapped[str] = mapped_column(String(128))
    value: Mapped[float] = mapped_column(Float)
    recorded_at: Mapped[datetime]


class EventRow(Base):
    __tablename__ = "events"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str | None] = mapped_column(
        ForeignKey("runs.id", ondelete="CASCADE"), index=True
    )
    kind: Mapped[str] = mapped_column(String(64))
    detail: Mapped[str] = mapped_column(Text)
    device: Mapped[str | None] = mapped_column(String(128))
    round: Mapped[int | None] = mapped_column(Integer)
    at: Mapped[datetime]


class StoreSettingRow(Base):
    """Settings of the store itself, e.g. ``checkpoint_root``: where its checkpoint files are,
    so that every command that opens the database finds them."""

    __tablename__ = "store_settings"
    key: Mapped[str] = mapped_column(String(64), primary_key=True)
    value: Mapped[str] = mapped_column(Text)


class RunProfileRow(Base):
    """The model profile a run planned with (a JSON document the coordinator keys by model
    config, batch size and local loss), so that a restart that must re-plan does not profile."""

    __tablename__ = "run_profiles"
    run_id: Mapped[str] = mapped_column(ForeignKey("runs.id", ondelete="CASCADE"), primary_key=True)
    document: Mapped[dict[str, Any]]
    recorded_at: Mapped[datetime]


class PendingCheckpointRow(Base):
    """A checkpoint file a commit of ``run_id`` is about to write and refer to: recorded
    before the file is written, deleted in the transaction that commits the round. What a
    killed commit left is its run's coordinator's to remove on restart; garbage collection
    spares the files of the others."""

    __tablename__ = "pending_checkpoints"
    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    run_id: Mapped[str] = mapped_column(String(128), index=True)
    sha256: Mapped[str] = mapped_column(String(64), index=True)
    created_at: Mapped[datetime]


class RunLeaseRow(Base):
    """Which coordinator drives ``run_id`` (:mod:`storage.lease`); no foreign key, since a
    coordinator claims the lease before it creates a new run."""

    __tablename__ = "run_leases"
    run_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    holder: Mapped[str] = mapped_column(String(64))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    ttl_seconds: Mapped[float] = mapped_column(Float)
    acquired_at: Mapped[datetime]
    renewed_at: Mapped[datetime]
    beats: Mapped[int] = mapped_column(BigInteger)
