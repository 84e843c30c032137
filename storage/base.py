"""The run-store interface used by the coordinator, and the checks both backends share."""

from __future__ import annotations

import abc
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from storage.errors import CheckpointError, StateError
from storage.lease import Lease
from storage.records import (
    DEVICE_STATUSES,
    ROUND_STATES,
    RUN_STATUSES,
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

__all__ = ["RunStore"]


def plan_version(run_id: str, current: int, revise: bool) -> int:
    """The version a stored plan gets: the next one, or with ``revise`` the current one
    (:class:`StateError` when the run has no plan to revise)."""
    if not revise:
        return current + 1
    if current < 1:
        raise StateError(f"run {run_id!r} has no plan to revise; store one first")
    return current


def _check(value: str, valid: tuple[str, ...], field: str) -> None:
    if value not in valid:
        raise ValueError(f"{field}: {value!r} is not one of {valid}")


class RunStore(abc.ABC):
    """Everything a coordinator must keep to survive a restart.

    A round moves ``open -> aggregating -> committed``; :meth:`commit_round` is atomic: the
    checkpoint is durable before the round becomes current, so after a crash the run's current
    round is either the previous one or the new one, never a mix.
    """

    # ---------------------------------------------------------------- devices
    def upsert_device(self, device: DeviceRecord) -> None:
        """Insert or replace ``device``; one seen ``online`` without a time is seen now."""
        _check(device.status, DEVICE_STATUSES, "status")
        if device.status == "online" and device.last_seen is None:
            device = replace(device, last_seen=utcnow())
        self._upsert_device(device)

    @abc.abstractmethod
    def _upsert_device(self, device: DeviceRecord) -> None: ...

    @abc.abstractmethod
    def get_device(self, name: str) -> DeviceRecord: ...

    @abc.abstractmethod
    def list_devices(self) -> list[DeviceRecord]: ...

    # ---------------------------------------------------------------- runs
    def create_run(self, run_id: str, config: Mapping[str, Any], seed: int) -> RunRecord:
        """Create a run in state ``created``; an existing id is a :class:`StateError`."""
        if not run_id or len(run_id) > 128:
            raise ValueError(f"run_id: expected 1-128 characters, got {run_id!r}")
        return self._create_run(run_id, dict(config), seed)

    @abc.abstractmethod
    def _create_run(self, run_id: str, config: dict[str, Any], seed: int) -> RunRecord: ...

    @abc.abstractmethod
    def get_run(self, run_id: str) -> RunRecord: ...

    @abc.abstractmethod
    def list_runs(self) -> list[RunRecord]: ...

    def set_run_status(self, run_id: str, status: str) -> None:
        _check(status, RUN_STATUSES, "status")
        self._set_run_status(run_id, status)

    @abc.abstractmethod
    def _set_run_status(self, run_id: str, status: str) -> None: ...

    @abc.abstractmethod
    def set_run_config(self, run_id: str, config: Mapping[str, Any]) -> None:
        """Replace the run's stored config (a resume allowed to change it records why)."""

    @abc.abstractmethod
    def set_plan(self, run_id: str, plan: Mapping[str, Any], *, revise: bool = False) -> int:
        """Store a new plan for the run; return its version (1, 2, ...). ``revise``: replace
        the current version's document instead (the same plan with more noted beside it, such
        as the speeds measured while it ran); the version stays, and a run with no plan yet
        raises :class:`StateError`."""

    @abc.abstractmethod
    def set_profile(self, run_id: str, document: Mapping[str, Any]) -> None:
        """Store the model profile the run planned with (a JSON document; the coordinator
        keys it by what the profile depends on), replacing any earlier one."""

    @abc.abstractmethod
    def get_profile(self, run_id: str) -> dict[str, Any] | None:
        """The run's stored profile document, or None."""

    # ---------------------------------------------------------------- rounds
    @abc.abstractmethod
    def open_round(self, run_id: str, number: int, participants: Sequence[str]) -> RoundRecord:
        """Open round ``number``, or reopen it (new participants, results cleared) if it was
        opened before and never committed, as after a crash or a retry."""

    @abc.abstractmethod
    def record_result(self, run_id: str, number: int, result: DeviceResult) -> None:
        """Record (or replace) one device's result for an open round."""

    def record_results(self, run_id: str, number: int, results: Sequence[DeviceResult]) -> None:
        """Record many devices' results at once; a batch with an invalid result changes
        nothing (one transaction where the backend allows)."""
        for result in results:
            validate_result(result)
        for result in results:
            self.record_result(run_id, number, result)

    def set_round_state(self, run_id: str, number: int, state: str) -> None:
        _check(state, ROUND_STATES, "state")
        if state == "committed":
            raise StateError("use commit_round to commit a round")
        self._set_round_state(run_id, number, state)

    @abc.abstractmethod
    def _set_round_state(self, run_id: str, number: int, state: str) -> None: ...

    @abc.abstractmethod
    def commit_round(
        self,
        run_id: str,
        number: int,
        weights: Mapping[str, Tensors],
        optimizer_states: Mapping[str, Tensors] | None = None,
        metrics: Mapping[str, float] | None = None,
        evaluation: Mapping[str, float] | None = None,
    ) -> RoundRecord:
        """Atomically store the round's aggregated weights and make it the run's current one."""

    @abc.abstractmethod
    def get_round(self, run_id: str, number: int) -> RoundRecord: ...

    @abc.abstractmethod
    def list_rounds(self, run_id: str) -> list[RoundRecord]: ...

    @abc.abstractmethod
    def checkpoint(self, run_id: str, number: int) -> ResumeState:
        """A committed round with its weights and optimizer states (``NotFoundError`` if the
        round does not exist, ``StateError`` if it is not committed)."""

    def resume(self, run_id: str) -> ResumeState | None:
        """The last committed round whose checkpoint verifies, with its weights and optimizer
        states, or None before the first commit. Rounds after it (their checkpoints corrupt or
        missing) are reopened, to be trained again, and a ``checkpoint-corrupt`` event says
        why; a run none of whose rounds verifies raises :class:`CheckpointError`."""
        if self.get_run(run_id).current_round is None:
            return None
        committed = [r.number for r in self.list_rounds(run_id) if r.state == "committed"]
        problems: list[str] = []
        for number in reversed(committed):
            try:
                state = self.checkpoint(run_id, number)
            except CheckpointError as error:
                problems.append(f"round {number}: {error}")
                continue
            if problems:
                detail = f"{'; '.join(problems)}; resuming from round {number}"
                self._rewind(run_id, number, Event("checkpoint-corrupt", detail))
                state = replace(state, run=self.get_run(run_id))
            return state
        raise CheckpointError(
            f"run {run_id!r}: no committed round has a usable checkpoint "
            f"({'; '.join(problems[:2])}); check the checkpoint folder (--checkpoints), "
            "or train a new run_id"
        )

    @abc.abstractmethod
    def _rewind(self, run_id: str, number: int | None, event: Event) -> None:
        """Make ``number`` the run's current round again: later rounds reopened without their
        checkpoints, results or metrics, and ``event`` recorded, in one step."""

    def round_problem(self, run_id: str, number: int, deep: bool = True) -> str | None:
        """Why round ``number``'s checkpoint cannot be used, or None when it verifies
        (``deep=False``: only that its files exist with their sizes, where files are kept)."""
        try:
            self.checkpoint(run_id, number)
        except (CheckpointError, StateError) as error:
            return str(error)
        return None

    # ---------------------------------------------------------------- metrics and events
    @abc.abstractmethod
    def add_metrics(self, run_id: str, points: Iterable[MetricPoint]) -> None: ...

    @abc.abstractmethod
    def metrics(self, run_id: str, name: str | None = None) -> list[MetricPoint]: ...

    @abc.abstractmethod
    def add_event(self, run_id: str | None, event: Event) -> None: ...

    def add_events(self, run_id: str | None, events: Sequence[Event]) -> None:
        """``events`` at once (in one transaction where the store has them)."""
        for event in events:
            self.add_event(run_id, event)

    @abc.abstractmethod
    def events(self, run_id: str | None = None) -> list[Event]: ...

    # ---------------------------------------------------------------- leases
    @abc.abstractmethod
    def lease(self, run_id: str) -> Lease | None:
        """Who holds ``run_id``'s lease (:mod:`storage.lease`); None when nobody does."""

    @abc.abstractmethod
    def claim_lease(self, lease: Lease, replacing: Lease | None = None) -> bool:
        """Take the lease for ``lease.holder``: only if nobody holds it when ``replacing`` is
        None, else only if it is still ``replacing``. False when someone else got there."""

    @abc.abstractmethod
    def renew_lease(self, run_id: str, holder: str) -> bool:
        """Renew ``holder``'s lease now; False when ``holder`` no longer holds it."""

    @abc.abstractmethod
    def release_lease(self, run_id: str, holder: str) -> None:
        """Give the lease up (nothing happens when ``holder`` does not hold it)."""

    @abc.abstractmethod
    def list_leases(self) -> list[Lease]: ...

    def fence(self, run_id: str, holder: str | None) -> None:
        """From now on every write to ``run_id`` through this store (rounds, results, commits,
        events, metrics, status) happens only while ``holder`` holds the run's lease, and
        renews it; else :class:`~storage.lease.LeaseLostError`. None lifts the condition."""
        fences: dict[str, str] = self.__dict__.setdefault("_fences", {})
        if holder is None:
            fences.pop(run_id, None)
        else:
            fences[run_id] = holder

    def fenced(self, run_id: str) -> str | None:
        """The holder :meth:`fence` set for ``run_id``, if any."""
        fences: dict[str, str] = self.__dict__.get("_fences", {})
        return fences.get(run_id)

    # ---------------------------------------------------------------- maintenance
    @abc.abstractmethod
    def integrity_problems(self, deep: bool = False) -> list[str]:
        """Inconsistencies between rows and checkpoint files; empty when all is well."""

    @abc.abstractmethod
    def collect_garbage(self, older_than_seconds: float = 3600.0) -> int:
        """Delete checkpoint files that no committed round refers to; return how many."""

    def discard_pending(self, run_id: str) -> int:
        """Delete what a killed commit of ``run_id`` left: the checkpoint files it recorded as
        about to be written that no committed round and no other run's commit under way refers
        to; return how many files. Only the run's (one) coordinator calls it, on starting: a
        commit of the run still under way elsewhere would lose its files."""
        return 0

    def check_can_commit(self) -> None:  # noqa: B027 - nothing to check in memory
        """Raise :class:`StoreError` now, before any training, if :meth:`commit_round` could
        not store a checkpoint (opened read-only, or no checkpoint folder known)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files."""

    def outages(self) -> list[float]:
        """How long (seconds) each outage of the database server that the store waited out
        lasted, those ended since the last call (none in memory)."""
        return []

    def stop_waiting(self) -> None:  # noqa: B027 - no server to wait for in memory
        """From now on, fail at once where the database server does not answer, instead of
        waiting for it (a coordinator told to stop records what it can and exits)."""

    def __enter__(self) -> RunStore:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def validate_result(result: DeviceResult) -> None:
    """Reject results that no device can have produced."""
    if result.examples < 0 or result.bytes_sent < 0 or result.bytes_received < 0:
        raise ValueError(f"result of {result.device!r}: counts must be >= 0")
    if result.wall_seconds < 0:
        raise ValueError(f"result of {result.device!r}: wall_seconds must be >= 0")
