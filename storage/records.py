"""Plain records the run store reads and writes; no ORM or database types leak out."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np

__all__ = [
    "DEVICE_STATUSES",
    "ENDED_STATUSES",
    "ROUND_STATES",
    "RUN_STATUSES",
    "CheckpointRef",
    "DeviceRecord",
    "DeviceResult",
    "Event",
    "MetricPoint",
    "ResumeState",
    "RoundRecord",
    "RunRecord",
    "Tensors",
    "utcnow",
]

RUN_STATUSES = ("created", "planning", "training", "finished", "failed", "cancelled")
ENDED_STATUSES = RUN_STATUSES[3:]  # a run in one of these is driven by nobody
ROUND_STATES = ("open", "aggregating", "committed")
DEVICE_STATUSES = ("unknown", "online", "offline")

Tensors = Mapping[str, np.ndarray]  # tensor name -> array, one segment's weights or state


def utcnow() -> datetime:
    return datetime.now(UTC)


@dataclass(frozen=True)
class DeviceRecord:
    """A device and its declared capabilities.

    ``credentials_ref`` names where a secret is kept; the store never holds a secret itself.
    """

    name: str
    kind: str
    memory_bytes: int
    flops: float
    uplink_bytes: float | None = None
    credentials_ref: str | None = None
    status: str = "unknown"
    last_seen: datetime | None = None


@dataclass(frozen=True)
class RunRecord:
    run_id: str
    config: dict[str, Any]
    status: str
    seed: int
    created_at: datetime
    updated_at: datetime
    plan: dict[str, Any] | None = None
    plan_version: int = 0
    current_round: int | None = None  # the last committed round


@dataclass(frozen=True)
class DeviceResult:
    """What one device reported for one round (or why it failed)."""

    device: str
    examples: int = 0
    loss: float | None = None
    accuracy: float | None = None
    bytes_sent: int = 0
    bytes_received: int = 0
    wall_seconds: float = 0.0
    peak_memory_bytes: int | None = None
    failure: str | None = None


@dataclass(frozen=True)
class RoundRecord:
    run_id: str
    number: int
    state: str
    participants: tuple[str, ...]
    results: tuple[DeviceResult, ...] = ()
    metrics: dict[str, float] = field(default_factory=dict)
    evaluation: dict[str, float] = field(default_factory=dict)
    opened_at: datetime | None = None
    committed_at: datetime | None = None


@dataclass(frozen=True)
class CheckpointRef:
    """One stored safetensors file: a segment's weights or optimizer state for a round."""

    segment: str
    kind: str  # "weights" | "optimizer"
    sha256: str
    size_bytes: int


@dataclass(frozen=True)
class MetricPoint:
    name: str
    value: float
    round: int | None = None
    device: str | None = None
    recorded_at: datetime | None = None


@dataclass(frozen=True)
class Event:
    kind: str
    detail: str = ""
    device: str | None = None
    round: int | None = None
    at: datetime | None = None


@dataclass(frozen=True)
class ResumeState:
    """Everything needed to continue a run from its last committed round."""

    run: RunRecord
    round: RoundRecord
    weights: dict[str, dict[str, np.ndarray]]
    optimizer_states: dict[str, dict[str, np.ndarray]]
    checkpoints: tuple[CheckpointRef, ...]

    @property
    def plan(self) -> dict[str, Any] | None:
        return self.run.plan

    @property
    def participants(self) -> tuple[str, ...]:
        return self.round.participants
