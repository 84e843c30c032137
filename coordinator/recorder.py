"""What a round leaves behind: aggregation, evaluation, the commit and the observer's calls."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import FedAvg

from coordinator.aggregation import flower_quiet
from coordinator.assignments import Assignment, keys_for, span
from coordinator.server_state import (
    restore_server_state,
    restore_server_tensors,
    server_state,
    server_tensors,
)
from split_models.mirror import with_mirrored_heads
from storage.base import RunStore
from storage.errors import NotFoundError
from storage.records import DeviceResult, Event, MetricPoint, ResumeState, RoundRecord
from wire.flower import array_numpy, array_record, numpy_arrays

if TYPE_CHECKING:
    from coordinator.planner import Placement

__all__ = [
    "LOCAL_PREFIX",
    "STRATEGY_SEGMENT",
    "WEIGHTS_SEGMENT",
    "Evaluate",
    "Outcome",
    "RoundObserver",
    "RoundRecorder",
    "device_records",
    "round_problem",
]

log = logging.getLogger(__name__)
WEIGHTS_SEGMENT = "global"
LOCAL_PREFIX = "local:"  # a round's checkpoint segment of one device's own tensors (FedBN)
STRATEGY_SEGMENT = "strategy"  # a checkpoint's optimizer segment: the strategy's server state
Evaluate = Callable[[Mapping[str, np.ndarray]], dict[str, float]]


class RoundObserver:
    """What a coordinator tells about its rounds; the base class ignores it all."""

    def round_starting(self, number: int) -> None:
        """Round ``number`` (or a retry of it) is about to select its devices."""

    def round_started(self, number: int, devices: list[str]) -> None:
        """The round's messages went out to ``devices`` (edges and GPU servers)."""

    def device_answered(self, device: str) -> None:
        """``device`` replied (trained or failed) in the current round."""

    def round_committed(
        self,
        number: int,
        evaluation: dict[str, float],
        results: list[DeviceResult],
        servers: Sequence[str] = (),
        clients: int | None = None,
    ) -> None:
        """Round ``number`` is committed to the store; ``results`` are every device's, those
        of the GPU servers (named in ``servers``) among them; ``clients``: the clients the
        edges trained where they are simulation hosts of several (``group_clients``)."""


@dataclass
class Outcome:
    """One attempt's replies: each device's result, who trained, and what else each reported
    per device (cut-layer bytes; a simulation host's clients trained), stored as metrics."""

    results: list[DeviceResult]
    ok: list[str]
    reported: dict[str, dict[str, float]] = field(default_factory=dict)
    started: float = 0.0
    diverged: list[str] = field(default_factory=list)  # sent NaN or infinite weights
    silent: list[str] = field(default_factory=list)  # sent no reply (offline, or too late)


class RoundRecorder:
    """Aggregates with ``strategy``, evaluates with ``evaluate`` and commits to ``store``.

    ``local_keys`` names tensors each device keeps as its own (FedBN's BatchNorm layers):
    they are still aggregated into the global weights, and each device's trained copy is
    committed with the round (segment ``local:<device>``) and sent back to it next time
    (:meth:`own`)."""

    def __init__(
        self,
        store: RunStore,
        run_id: str,
        strategy: FedAvg,
        observer: RoundObserver,
        evaluate: Evaluate | None = None,
        rounds: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.store, self.run_id, self.strategy = store, run_id, strategy
        self.observer, self.evaluate, self.rounds, self._clock = observer, evaluate, rounds, clock
        self.local_keys: frozenset[str] = frozenset()
        self.local: dict[str, dict[str, np.ndarray]] = {}  # device -> its committed own tensors
        self._pending: dict[str, dict[str, np.ndarray]] = {}
        # the strategy's server-side state before the aggregation of a try not yet committed
        self._before: dict[str, Any] | None = None
        self.last_failure = ""  # why the last try failed, or waited (named when a round gives up)
        self._said: dict[tuple[str, str], int] = {}  # events logged as warnings: first round

    def keep_local(
        self,
        keys: frozenset[str],
        resumed: Mapping[str, Mapping[str, np.ndarray]] | None = None,
    ) -> None:
        """Keep ``keys`` per device from now on, starting from the devices' own tensors in
        ``resumed`` (a resumed round's checkpoint segments), if any."""
        self.local_keys = keys
        self.local = {
            name.removeprefix(LOCAL_PREFIX): dict(tensors)
            for name, tensors in (resumed or {}).items()
            if name.startswith(LOCAL_PREFIX)
        }

    def take_up(self, resumed: ResumeState | None, weights: Mapping[str, np.ndarray]) -> None:
        """Go on from ``resumed``'s checkpoint (none: a new run): the strategy's server-side
        optimizer state, for the run's ``weights``; a saved tensor that does not fit them
        is left out and the run records why."""
        saved = {} if resumed is None else resumed.optimizer_states.get(STRATEGY_SEGMENT, {})
        if resumed is None or not saved:
            return
        dropped = restore_server_tensors(self.strategy, saved, weights)
        number = resumed.round.number
        if dropped:
            listed = "; ".join(dropped[:4]) + (
                f"; {len(dropped) - 4} more" if len(dropped) > 4 else ""
            )
            detail = f"server optimizer state left out, starting at zero: {listed}"
            self.event(number, "server-state", detail)
        log.info("resumed the strategy's server state (%d tensors)", len(saved) - len(dropped))

    def own(
        self, device: str, arrays: Mapping[str, np.ndarray], trained: bool = False
    ) -> dict[str, np.ndarray]:
        """``arrays`` for ``device``: its own copy of the local tensors where it has one (with
        ``trained``, the copy it sent in the round being aggregated, not yet committed: what
        the federated evaluation of that round uses)."""
        mine = (self._pending if trained else self.local).get(device, {})
        return {key: mine.get(key, value) for key, value in arrays.items()}

    def replanned(self, spans: Mapping[str, tuple[int, int, int | None]]) -> None:
        """A new plan (``spans``: device -> its blocks and head cut, :meth:`Placement.spans`):
        each device keeps its own copies of the local tensors it still holds. Copies of
        blocks it gives up would be stale by the time a later plan hands them back; it then
        starts from the shared ones."""
        self.local = {
            device: keys_for(own, *spans[device])
            for device, own in self.local.items()
            if device in spans
        }

    def open(self, number: int, participants: Sequence[str]) -> None:
        """Round ``number`` is (re)opened with ``participants``."""
        self.store.open_round(self.run_id, number, list(participants))

    def aggregate(
        self, number: int, replies: list[Message], devices: Sequence[str] = ()
    ) -> dict[str, np.ndarray] | None:
        """The round enters ``aggregating``; the strategy's new weights, or None.
        ``devices``: who sent each reply (by the message it answers, not by what it says)."""
        self.store.set_round_state(self.run_id, number, "aggregating")
        self._before = server_state(self.strategy)
        with flower_quiet():  # Flower logs each aggregation at INFO
            arrays, _ = self.strategy.aggregate_train(number, replies)
        for note in getattr(self.strategy, "notes", ()):  # groups a robust rule could not take
            self.event(number, "aggregation", note)
        for device, why in getattr(self.strategy, "clips", ()):  # updates the norm bound clipped
            self.event(number, "update-clipped", why, device)
        if arrays is None:
            return None
        if self.local_keys:
            self._pending = self._trained_local(replies, devices)
        return {k: array_numpy(v) for k, v in arrays.items()}  # no header parse (thread-safe)

    def event(self, number: int, kind: str, detail: str, device: str | None = None) -> None:
        """Something round ``number``'s aggregation did that the operator should know of (a
        group a rule could not take, a claim capped, an update clipped): stored every time,
        logged as a warning the first time, and at INFO when a later round repeats it (a
        strategy's fallback for one group holds every round)."""
        first = self._said.setdefault((kind, detail), number)
        if first == number:
            log.warning("round %d: %s", number, detail)
        else:
            log.info("round %d: %s (as since round %d)", number, detail, first)
        self.store.add_event(self.run_id, Event(kind, detail, device=device, round=number))

    def _trained_local(
        self, replies: list[Message], devices: Sequence[str]
    ) -> dict[str, dict[str, np.ndarray]]:
        """The committed local tensors updated by this round's replies."""
        pending = {device: dict(tensors) for device, tensors in self.local.items()}
        for device, reply in zip(devices, replies, strict=True):
            trained = numpy_arrays(reply, key=None)
            own = {k: v for k, v in trained.items() if k in self.local_keys}
            if own:
                pending.setdefault(device, {}).update(own)
        return pending

    def committed(self, number: int) -> RoundRecord | None:
        """Round ``number`` if it is committed (the one a new round is judged against)."""
        if number < 1:
            return None
        try:
            record = self.store.get_round(self.run_id, number)
        except NotFoundError:
            return None
        return record if record.state == "committed" else None

    def baseline(self, weights: Mapping[str, np.ndarray] | None) -> RoundRecord | None:
        """A stand-in for "round 0": the central evaluation of ``weights`` (none without
        them or without evaluation data)."""
        if weights is None or self.evaluate is None:
            return None
        return RoundRecord(self.run_id, 0, "committed", (), evaluation=self.evaluate(weights))

    def central_evaluation(self, weights: Mapping[str, np.ndarray]) -> dict[str, float]:
        """The evaluation on the coordinator's data; empty without it."""
        return self.evaluate(weights) if self.evaluate is not None else {}

    def failed(self, number: int, attempt: int, attempts: int, reason: str) -> None:
        """Attempt ``attempt`` of round ``number`` failed for ``reason``: logged and stored.
        A try aggregated but refused (it diverged) leaves the strategy's server-side state
        (FedAvgM's momentum, FedOpt's moments) as it was before it: the retry starts from the
        last committed round, its weights and that state."""
        if self._before is not None:
            restore_server_state(self.strategy, self._before)
            self._before = None
        log.warning("round %d attempt %d/%d failed: %s", number, attempt, attempts, reason)
        self.store.add_event(self.run_id, Event("round-failed", reason, round=number))
        self.last_failure = reason

    def waiting(self, number: int, attempt: int, attempts: int, reason: str) -> None:
        """Attempt ``attempt`` of round ``number`` cannot start (``reason``: devices it needs
        are offline) and waits for them, up to a round deadline: logged and stored once."""
        log.warning(
            "round %d attempt %d/%d waits for its devices: %s", number, attempt, attempts, reason
        )
        self.store.add_event(self.run_id, Event("round-waiting", reason, round=number))
        self.last_failure = reason

    def record(self, number: int, outcome: Outcome) -> None:
        """The results of an attempt that does not commit."""
        self.store.record_results(self.run_id, number, outcome.results)

    def commit(
        self,
        number: int,
        weights: dict[str, np.ndarray],
        outcome: Outcome,
        evaluation: dict[str, float],
        servers: Sequence[str] = (),
    ) -> None:
        """Results, metrics, weights and evaluation of round ``number``, in the store; the
        checkpoint files no committed round refers to any more are collected."""
        store, self._before = self.store, None
        store.record_results(self.run_id, number, outcome.results)
        trained = [r for r in outcome.results if not r.failure]
        metrics = _round_metrics(outcome, trained, servers)
        metrics["wall_seconds"] = self._clock() - outcome.started
        points = _points(number, outcome, trained)
        if points:
            store.add_metrics(self.run_id, points)
        segments = {WEIGHTS_SEGMENT: weights}
        if self.local_keys:
            segments |= {LOCAL_PREFIX + d: t for d, t in sorted(self._pending.items())}
        server = server_tensors(self.strategy)
        store.commit_round(
            self.run_id,
            number,
            segments,
            optimizer_states={STRATEGY_SEGMENT: server} if server else None,
            metrics=metrics,
            evaluation=evaluation,
        )
        if self.local_keys:
            self.local = self._pending
        store.collect_garbage()  # files a crash left before its commit's transaction
        for seconds in store.outages():  # the run's history says what the log said
            detail = f"the database did not answer for {seconds:.1f} s; waited for it"
            store.add_event(self.run_id, Event("database-outage", detail, round=number))
        clients = int(metrics["clients"]) if "clients" in metrics else None
        self.observer.round_committed(number, evaluation, outcome.results, servers, clients)
        failed = ", ".join(f"{r.device} ({r.failure})" for r in outcome.results if r.failure)
        log.info(
            "round %d/%d committed: %s, %d edge(s) and %d GPU server(s) trained%s, %.1f s",
            number,
            self.rounds,
            ", ".join(f"{k} {v:.4f}" for k, v in evaluation.items()) or "no eval data",
            *(int(metrics[key]) for key in ("participants_ok", "servers_ok")),
            f", without {failed}" if failed else "",
            metrics["wall_seconds"],
        )


def _round_metrics(
    outcome: Outcome, trained: list[DeviceResult], servers: Sequence[str]
) -> dict[str, float]:
    """Edges and their examples, the GPU servers' apart; where the edges are simulation
    hosts (``group_clients``), also the clients they trained."""
    edges = [r for r in trained if r.device not in servers]
    metrics = {
        "participants_ok": float(len(edges)),
        "examples": float(sum(r.examples for r in edges)),
        "servers_ok": float(len(trained) - len(edges)),
        "server_examples": float(sum(r.examples for r in trained if r.device in servers)),
    }
    clients = [outcome.reported.get(r.device, {}).get("clients") for r in edges]
    if any(c is not None for c in clients):
        metrics["clients"] = float(sum(c or 0.0 for c in clients))
    return metrics


def _points(number: int, outcome: Outcome, trained: list[DeviceResult]) -> list[MetricPoint]:
    """Per-device metrics: measured peak memory and cut-layer bytes."""
    points = [
        MetricPoint("peak_memory_bytes", float(r.peak_memory_bytes), number, r.device)
        for r in outcome.results
        if r.peak_memory_bytes is not None
    ]
    return points + [
        MetricPoint(name, value, number, r.device)
        for r in trained
        for name, value in outcome.reported.get(r.device, {}).items()
    ]


def device_records(
    recorder: RoundRecorder,
    weights: dict[str, np.ndarray],
    spans: dict[str, tuple[int, int, int | None]],
    mirrors: Mapping[int, Mapping[str, str]],
) -> Callable[[str], ArrayRecord]:
    """A device's weights for the round as a Flower record: built once per span and shared by
    the devices that train it (1,000 clients on two cuts encode two records, not 1,000),
    unless the device keeps its own copies of some tensors (FedBN). An edge whose head cut is
    in ``mirrors`` gets the back's weights as its head's (``split_models.mirror``)."""
    records: dict[tuple[str, tuple[int, int, int | None]], ArrayRecord] = {}

    def arrays_for(device: str) -> ArrayRecord:
        key = (device if device in recorder.local else "", spans[device])
        if key not in records:
            start, end, head = spans[device]
            chosen = keys_for(weights, start, end, head)
            if start == 0 and head is not None and head in mirrors:  # an edge (not a piece)
                chosen = with_mirrored_heads(chosen, weights, mirrors[head])
            records[key] = array_record(recorder.own(device, chosen))
        return records[key]

    return arrays_for


def round_problem(
    placement: Placement, servers: Sequence[Assignment], edges: int, needed: int
) -> str | None:
    """Why a round of ``placement`` cannot start with ``servers`` online and ``edges`` edges
    selected (``needed``: the run's least); None when it can."""
    missing = sorted({span(b) for b in placement.servers} - {span(b) for b in servers})
    if missing:
        pieces = ", ".join(f"[{a}, {b})" for a, b in missing)
        return f"no GPU server holding blocks {pieces} is online"
    if edges < needed:
        return f"{edges} edge(s) online, {needed} needed"
    return None
