"""The in-memory twin of the SQL run store, for unit tests and throw-away simulations."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from storage.base import RunStore, plan_version, validate_result
from storage.errors import NotFoundError, StateError
from storage.lease import Lease, lost_error
from storage.records import (
    CheckpointRef,
    DeviceRecord,
    DeviceResult,
    Event,
    MetricPoint,
    ResumeState,
    RoundRecord,
    RunRecord,
    Tensors,
    utcnow,
)

__all__ = ["InMemoryRunStore"]


def _copy(tensors: Mapping[str, Tensors]) -> dict[str, dict[str, np.ndarray]]:
    return {
        segment: {k: np.array(v, copy=True) for k, v in t.items()} for segment, t in tensors.items()
    }


class InMemoryRunStore(RunStore):
    """Dictionaries behind a lock; same behaviour as the SQL store, nothing persisted."""

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._devices: dict[str, DeviceRecord] = {}
        self._runs: dict[str, RunRecord] = {}
        self._rounds: dict[tuple[str, int], RoundRecord] = {}
        self._weights: dict[tuple[str, int], tuple[dict[str, Any], dict[str, Any]]] = {}
        self._metrics: dict[str, list[MetricPoint]] = {}
        self._events: list[tuple[str | None, Event]] = []
        self._profiles: dict[str, dict[str, Any]] = {}
        self._leases: dict[str, Lease] = {}

    def _upsert_device(self, device: DeviceRecord) -> None:
        with self._lock:
            self._devices[device.name] = device

    def get_device(self, name: str) -> DeviceRecord:
        with self._lock:
            if name not in self._devices:
                raise NotFoundError(f"no device named {name!r}")
            return self._devices[name]

    def list_devices(self) -> list[DeviceRecord]:
        with self._lock:
            return sorted(self._devices.values(), key=lambda d: d.name)

    def _create_run(self, run_id: str, config: dict[str, Any], seed: int) -> RunRecord:
        with self._lock:
            if run_id in self._runs:
                raise StateError(f"run {run_id!r} exists already")
            now = utcnow()
            self._runs[run_id] = RunRecord(run_id, config, "created", seed, now, now)
            return self._runs[run_id]

    def get_run(self, run_id: str) -> RunRecord:
        with self._lock:
            if run_id not in self._runs:
                raise NotFoundError(f"no run {run_id!r}")
            return self._runs[run_id]

    def list_runs(self) -> list[RunRecord]:
        with self._lock:
            return sorted(self._runs.values(), key=lambda r: r.created_at)

    def _update_run(self, run_id: str, **changes: Any) -> RunRecord:
        run = replace(self.get_run(run_id), updated_at=utcnow(), **changes)
        self._runs[run_id] = run
        return run

    def _set_run_status(self, run_id: str, status: str) -> None:
        with self._lock:
            self._fence(run_id)
            self._update_run(run_id, status=status)

    def set_run_config(self, run_id: str, config: Mapping[str, Any]) -> None:
        with self._lock:
            self._fence(run_id)
            self._update_run(run_id, config=dict(config))

    def set_plan(self, run_id: str, plan: Mapping[str, Any], *, revise: bool = False) -> int:
        with self._lock:
            self._fence(run_id)
            run = self.get_run(run_id)
            version = plan_version(run_id, run.plan_version, revise)
            self._update_run(run_id, plan=dict(plan), plan_version=version)
            return version

    def set_profile(self, run_id: str, document: Mapping[str, Any]) -> None:
        with self._lock:
            self._fence(run_id)
            self.get_run(run_id)
            self._profiles[run_id] = json.loads(json.dumps(dict(document)))  # as SQL keeps it

    def get_profile(self, run_id: str) -> dict[str, Any] | None:
        with self._lock:
            stored = self._profiles.get(run_id)
            return None if stored is None else json.loads(json.dumps(stored))

    def open_round(self, run_id: str, number: int, participants: Sequence[str]) -> RoundRecord:
        with self._lock:
            self._fence(run_id)
            self.get_run(run_id)
            existing = self._rounds.get((run_id, number))
            if existing is not None and existing.state == "committed":
                raise StateError(f"round {number} of run {run_id!r} is committed already")
            record = RoundRecord(run_id, number, "open", tuple(participants), opened_at=utcnow())
            self._rounds[(run_id, number)] = record
            return record

    def _open_round(self, run_id: str, number: int) -> RoundRecord:
        record = self.get_round(run_id, number)
        if record.state == "committed":
            raise StateError(f"round {number} of run {run_id!r} is committed already")
        return record

    def record_result(self, run_id: str, number: int, result: DeviceResult) -> None:
        validate_result(result)
        with self._lock:
            self._fence(run_id)
            record = self._open_round(run_id, number)
            others = tuple(r for r in record.results if r.device != result.device)
            self._rounds[(run_id, number)] = replace(record, results=(*others, result))

    def _set_round_state(self, run_id: str, number: int, state: str) -> None:
        with self._lock:
            self._fence(run_id)
            record = self._open_round(run_id, number)
            self._rounds[(run_id, number)] = replace(record, state=state)

    def commit_round(
        self,
        run_id: str,
        number: int,
        weights: Mapping[str, Tensors],
        optimizer_states: Mapping[str, Tensors] | None = None,
        metrics: Mapping[str, float] | None = None,
        evaluation: Mapping[str, float] | None = None,
    ) -> RoundRecord:
        if not weights:
            raise ValueError("commit_round: weights must name at least one segment")
        with self._lock:
            self._fence(run_id)
            record = self._open_round(run_id, number)
            self._weights[(run_id, number)] = (_copy(weights), _copy(optimizer_states or {}))
            record = replace(
                record,
                state="committed",
                committed_at=utcnow(),
                metrics=dict(metrics or {}),
                evaluation=dict(evaluation or {}),
            )
            self._rounds[(run_id, number)] = record
            current = self.get_run(run_id).current_round
            if current is None or number > current:
                self._update_run(run_id, current_round=number)
            return record

    # ---------------------------------------------------------------- leases
    def _fence(self, run_id: str | None) -> None:
        """Renew the fenced holder's lease on ``run_id`` before a write, or raise."""
        if run_id is None or (holder := self.fenced(run_id)) is None:
            return
        if not self.renew_lease(run_id, holder):
            raise lost_error(run_id, self._leases.get(run_id))

    def lease(self, run_id: str) -> Lease | None:
        with self._lock:
            return self._leases.get(run_id)

    def claim_lease(self, lease: Lease, replacing: Lease | None = None) -> bool:
        with self._lock:
            held = self._leases.get(lease.run_id)
            if replacing is None and held is not None:
                return False
            if replacing is not None and (
                held is None or (held.holder, held.beats) != (replacing.holder, replacing.beats)
            ):
                return False
            beats = 0 if replacing is None else replacing.beats + 1
            self._leases[lease.run_id] = replace(lease, beats=beats)
            return True

    def renew_lease(self, run_id: str, holder: str) -> bool:
        with self._lock:
            held = self._leases.get(run_id)
            if held is None or held.holder != holder:
                return False
            self._leases[run_id] = replace(held, renewed_at=utcnow(), beats=held.beats + 1)
            return True

    def release_lease(self, run_id: str, holder: str) -> None:
        with self._lock:
            if (held := self._leases.get(run_id)) is not None and held.holder == holder:
                del self._leases[run_id]

    def list_leases(self) -> list[Lease]:
        with self._lock:
            return list(self._leases.values())

    def get_round(self, run_id: str, number: int) -> RoundRecord:
        with self._lock:
            if (run_id, number) not in self._rounds:
                raise NotFoundError(f"no round {number} in run {run_id!r}")
            return self._rounds[(run_id, number)]

    def list_rounds(self, run_id: str) -> list[RoundRecord]:
        with self._lock:
            self.get_run(run_id)
            return sorted(
                (r for (rid, _), r in self._rounds.items() if rid == run_id), key=lambda r: r.number
            )

    def checkpoint(self, run_id: str, number: int) -> ResumeState:
        with self._lock:
            record = self.get_round(run_id, number)
            if record.state != "committed":
                raise StateError(f"round {number} of run {run_id!r} is not committed")
            weights, states = self._weights[(run_id, number)]
            refs = tuple(CheckpointRef(s, "weights", "", 0) for s in weights)
            return ResumeState(self.get_run(run_id), record, _copy(weights), _copy(states), refs)

    def add_metrics(self, run_id: str, points: Iterable[MetricPoint]) -> None:
        with self._lock:
            self._fence(run_id)
            self.get_run(run_id)
            stamped = [p if p.recorded_at else replace(p, recorded_at=utcnow()) for p in points]
            self._metrics.setdefault(run_id, []).extend(stamped)

    def metrics(self, run_id: str, name: str | None = None) -> list[MetricPoint]:
        with self._lock:
            return [p for p in self._metrics.get(run_id, []) if name is None or p.name == name]

    def add_event(self, run_id: str | None, event: Event) -> None:
        with self._lock:
            self._fence(run_id)
            if run_id is not None:
                self.get_run(run_id)
            self._events.append((run_id, event if event.at else replace(event, at=utcnow())))

    def events(self, run_id: str | None = None) -> list[Event]:
        with self._lock:
            return [e for rid, e in self._events if run_id is None or rid == run_id]

    def integrity_problems(self, deep: bool = False) -> list[str]:
        with self._lock:
            problems = []
            for run in self._runs.values():
                if (
                    run.current_round is not None
                    and (run.run_id, run.current_round) not in self._weights
                ):
                    problems.append(f"run {run.run_id!r}: current round has no checkpoint")
            return problems

    def _rewind(self, run_id: str, number: int | None, event: Event) -> None:
        with self._lock:
            for key, record in list(self._rounds.items()):
                if key[0] == run_id and key[1] > (number or 0):
                    self._rounds[key] = replace(record, state="open", committed_at=None, results=())
                    self._weights.pop(key, None)
            points = self._metrics.get(run_id, [])
            self._metrics[run_id] = [p for p in points if (p.round or 0) <= (number or 0)]
            self._update_run(run_id, current_round=number)
            self.add_event(run_id, event)

    def collect_garbage(self, older_than_seconds: float = 3600.0) -> int:
        return 0
