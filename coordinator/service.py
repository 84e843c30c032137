"""The coordinator service: one run from device discovery to the last committed round.

1. Create the run in the store, or resume it (same run id, committed rounds): its last
   committed weights become the starting point and only the remaining rounds run. Each process
   announces a new session id (retained, :mod:`wire.session`), so devices still waiting inside
   a round of a crashed predecessor give it up instead of waiting for its deadline.
2. Wait for the declared devices: each announces its capabilities (retained) and keeps a Flower
   node online; after ``devices.wait`` the coordinator stops with a message naming who is missing.
3. Plan: profile the model in a fresh process, split it over the devices' memory and speed
   (:func:`coordinator.partitioner.plan_split`), ask every edge whether it accepts its blocks and
   plan again without the ones that refuse (their reasons are logged and stored). A resumed run
   keeps its stored plan while all its devices are online.
4. Rounds: the Flower strategy samples the edges; each edge and the GPU server get a ``train``
   message with their blocks' weights and their :class:`~wire.roles.Task`. Replies are awaited
   until the round's deadline (or until every missing device is offline). The round commits
   with the edges that finished if the GPU server answered and at least ``min_train_nodes``
   edges did (default 1); otherwise it is retried, up to ``max_attempts`` times. Aggregation is
   the strategy's; the assembled model is evaluated on ``eval_data``; weights, evaluation and
   every device's result (or failure reason) are committed in one transaction.
"""

from __future__ import annotations

import itertools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from coordinator.aggregation import build_strategy
from coordinator.config import RunConfig
from coordinator.partitioner import PartitionConfig, plan_split
from split_models.data import load_dataset
from split_models.devices import DeviceSpec
from split_models.errors import ConfigError, InfeasiblePlanError, SplitError
from split_models.evaluation import evaluate_weights
from split_models.isolated import profile_in_fresh_process
from split_models.memory import estimate_segment_memory
from split_models.plan import Plan
from split_models.profiler import ModelProfile
from split_models.segment import Segment
from split_models.units import format_bytes
from split_models.weights import segment_state
from split_models.zoo import build_model
from storage.base import RunStore
from storage.errors import NotFoundError
from storage.records import DeviceRecord, DeviceResult, Event, MetricPoint
from wire import topics
from wire.errors import WireError
from wire.flower import TransportGrid, array_record
from wire.roles import Announcement, Task, node_id_for
from wire.session import new_session
from wire.transport import Transport

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "RoundObserver",
    "evaluate_weights",
    "initial_weights",
]

log = logging.getLogger(__name__)
WEIGHTS_SEGMENT = "global"
_POLL = 0.1


class CoordinatorError(RuntimeError):
    """The run cannot go on (devices missing, every attempt of a round failed...)."""


def initial_weights(
    model_name: str,
    input_shape: tuple[int, ...],
    num_classes: int,
    local_loss: str,
    cuts: Sequence[int],
    seed: int,
) -> dict[str, np.ndarray]:
    """The model's blocks and a local head for every cut, all from ``seed``."""
    model = build_model(model_name, input_shape, num_classes, seed=seed)
    weights = segment_state(Segment.from_model(model, 0, model.num_blocks))
    for cut in sorted(set(cuts)):
        torch.manual_seed(seed * 1000 + cut)
        weights |= {
            k: v
            for k, v in segment_state(Segment.from_model(model, 0, cut, local_loss)).items()
            if k.startswith("head")
        }
    return weights


def _keys_for(
    weights: Mapping[str, np.ndarray], start: int, end: int, head: int | None
) -> dict[str, np.ndarray]:
    prefixes = tuple(f"block{b}." for b in range(start, end))
    chosen = {k: v for k, v in weights.items() if k.startswith(prefixes)}
    if head is not None:
        chosen |= {k: v for k, v in weights.items() if k.startswith(f"head{head}.")}
    return chosen


@dataclass(frozen=True)
class _Assignment:
    device: str
    start: int
    end: int
    estimate: int
    role: str

    @property
    def node(self) -> int:
        return node_id_for(self.device)


def _span(assignment: _Assignment) -> tuple[int, int]:
    return assignment.start, assignment.end


def _route(
    edges: Sequence[_Assignment], servers: Sequence[_Assignment]
) -> tuple[dict[str, str], dict[str, tuple[list[str], list[str], str, str | None]]]:
    """One round's stream layout. The servers' distinct block ranges are the pieces of the
    back, in order, each with its stream ``seg-<k>``; an edge feeds the piece its cut falls in;
    a piece hears its edges and, when the piece before it hears anyone, that piece's servers.

    Returns the stream of each edge and, for each server, (senders, peers sharing its piece,
    its stream, the next piece's stream or None)."""
    spans = sorted({_span(b) for b in servers})
    names = {span: f"seg-{index}" for index, span in enumerate(spans)}

    def piece(cut: int) -> tuple[int, int]:
        for span in spans:
            if span[0] <= cut < span[1]:
                return span
        raise AssertionError(f"no GPU server piece holds the blocks after cut {cut}")

    streams = {e.device: names[piece(e.end)] for e in edges}
    senders: dict[tuple[int, int], list[str]] = {
        span: [e.device for e in edges if piece(e.end) == span] for span in spans
    }
    for before, span in itertools.pairwise(spans):
        if senders[before]:
            senders[span] += [b.device for b in servers if _span(b) == before]
    routes = {}
    for back in servers:
        span = _span(back)
        index = spans.index(span)
        forward = names[spans[index + 1]] if index + 1 < len(spans) else None
        peers = [b.device for b in servers if _span(b) == span]
        routes[back.device] = (senders[span], peers, names[span], forward)
    return streams, routes


class _EdgeView(Grid):
    """The grid as the strategy's sampler sees it: only the online, assigned edges."""

    def __init__(self, grid: TransportGrid, nodes: Callable[[], list[int]]) -> None:
        self._grid, self._nodes = grid, nodes

    def get_node_ids(self) -> list[int]:
        return self._nodes()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._grid, name)

    # Grid's abstract methods, delegated
    def set_run(self, run: Any) -> None:
        self._grid.set_run(run)

    @property
    def run(self) -> Any:
        return self._grid.run

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self._grid.create_message(*args, **kwargs)

    def push_messages(self, messages: Any) -> Any:
        return self._grid.push_messages(messages)

    def pull_messages(self, message_ids: Any) -> Any:
        return self._grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> Any:
        return self._grid.send_and_receive(messages, timeout=timeout)


class RoundObserver:
    """What a coordinator tells about its rounds; the base class ignores it all."""

    def round_starting(self, number: int) -> None:
        """Round ``number`` (or a retry of it) is about to select its devices."""

    def round_started(self, number: int, devices: list[str]) -> None:
        """The round's messages went out to ``devices`` (edges and GPU servers)."""

    def device_answered(self, device: str) -> None:
        """``device`` replied (trained or failed) in the current round."""

    def round_committed(
        self, number: int, evaluation: dict[str, float], results: list[DeviceResult]
    ) -> None:
        """Round ``number`` is committed to the store."""


class Coordinator:
    """Runs ``config`` against the devices reachable through ``transport``."""

    def __init__(
        self,
        config: RunConfig,
        store: RunStore,
        transport: Transport,
        max_attempts: int = 3,
        profile: Callable[[RunConfig], ModelProfile] | None = None,
        observer: RoundObserver | None = None,
    ) -> None:
        """``observer``: told when a round starts, as each device answers and when a round
        commits (progress displays, simulated availability)."""
        self.config, self.store, self.transport = config, store, transport
        self.observer = observer or RoundObserver()
        self.max_attempts = max_attempts
        self.grid = TransportGrid(transport)
        self.session = new_session()  # devices drop work an earlier process asked for
        self._profile = profile or _profile_fresh
        self._announcements: dict[str, Announcement] = {}
        self._lock = threading.Lock()
        self.refusals: dict[str, str] = {}
        options = dict(config.aggregation.options)
        self.min_edges = int(options.pop("min_train_nodes", 1))
        options.pop("min_available_nodes", None)
        options.setdefault("fraction_evaluate", 0.0)
        flower = logging.getLogger("flwr")
        level = flower.level
        flower.setLevel(logging.ERROR)  # Flower warns that federated evaluation is off
        try:
            self.strategy = build_strategy(
                config.aggregation.name, min_available_nodes=1, min_train_nodes=1, **options
            )
        finally:
            flower.setLevel(level)
        self.eval_data = load_dataset(config.data.eval_data) if config.data.eval_data else None
        transport.subscribe(f"{topics.PREFIX}/capabilities/+", self._on_announcement)

    # ---------------------------------------------------------------- devices
    def _on_announcement(self, _topic: str, payload: bytes) -> None:
        if not payload:
            return  # a cleared retained message
        try:
            announcement = Announcement.parse(payload)
        except WireError as error:
            log.warning("ignored a bad device announcement: %s", error)
            return
        with self._lock:
            self._announcements[announcement.device] = announcement

    def online(self, role: str | None = None) -> dict[str, Announcement]:
        """Announced devices whose Flower node is online."""
        nodes = set(self.grid.get_node_ids())
        with self._lock:
            return {
                name: a
                for name, a in sorted(self._announcements.items())
                if a.node_id in nodes and (role is None or a.role == role)
            }

    def _missing(self) -> list[str]:
        declared = self.config.devices
        online_edges = self.online("edge")
        problems = []
        if isinstance(declared.edges, tuple):
            with self._lock:
                known = set(self._announcements)
            for name in declared.edges:
                if name not in online_edges:
                    problems.append(f"{name} ({'offline' if name in known else 'never announced'})")
        elif len(online_edges) < declared.edges:
            problems.append(
                f"{declared.edges - len(online_edges)} more edge(s); online: "
                f"{', '.join(online_edges) or 'none'}"
            )
        servers = self.online("gpu")
        if len(servers) < declared.gpu_servers:
            problems.append(
                f"{declared.gpu_servers - len(servers)} more GPU server(s); online: "
                f"{', '.join(servers) or 'none'}"
            )
        return problems

    def wait_for_devices(self) -> tuple[list[Announcement], list[Announcement]]:
        """The edges and GPU servers to plan with, once all declared ones are online."""
        wait = self.config.devices.wait_seconds
        deadline = time.monotonic() + wait
        told = 0.0
        while missing := self._missing():
            now = time.monotonic()
            if now >= deadline:
                raise CoordinatorError(
                    f"waited {wait:.0f} s for the devices; missing: {'; '.join(missing)}"
                )
            if now - told > 10:
                log.info("waiting for devices: %s", "; ".join(missing))
                told = now
            time.sleep(_POLL)
        edges = self.online("edge")
        if isinstance(self.config.devices.edges, tuple):
            chosen = [edges[n] for n in self.config.devices.edges]
        else:
            chosen = list(edges.values())[: self.config.devices.edges]
        servers = list(self.online("gpu").values())[: self.config.devices.gpu_servers]
        for device in [*chosen, *servers]:
            self.store.upsert_device(
                DeviceRecord(
                    device.device,
                    device.role,
                    device.memory,
                    device.flops,
                    device.uplink,
                    status="online",
                )
            )
        return chosen, servers

    # ---------------------------------------------------------------- planning
    def _task(
        self,
        assignment: _Assignment,
        edges: Sequence[str] = (),
        servers: Sequence[str] = (),
        segment: str = "seg-0",
        forward: str | None = None,
    ) -> Task:
        config = self.config
        extra: dict[str, Any] = {"session": self.session}
        if servers:
            extra["servers"] = list(servers)
        if forward is not None:
            extra["next"] = forward
        if assignment.role == "edge" and config.training.federated_eval > 0:
            extra["eval_fraction"] = config.training.federated_eval
        return Task(
            run=config.run_id,
            model=config.model.name,
            input_shape=config.model.input_shape,
            num_classes=config.model.num_classes,
            start=assignment.start,
            end=assignment.end,
            batch_size=config.training.batch_size,
            local_epochs=config.training.local_epochs,
            optimizer=asdict(config.training.optimizer),
            local_loss=config.training.local_loss,
            mode=config.training.mode,
            compression=config.training.compression,
            seed=config.training.seed,
            deadline_seconds=config.training.round_deadline_seconds,
            estimated_peak_bytes=assignment.estimate,
            edges=tuple(edges),
            segment=segment,
            extra=extra,
        )

    def _message(
        self,
        assignment: _Assignment,
        arrays: ArrayRecord,
        task: Task,
        kind: str,
        number: int = 0,
    ) -> Message:
        config = ConfigRecord({"task": task.to_json(), "server-round": number})
        content = RecordDict({"arrays": arrays, "config": config})
        return self.grid.create_message(content, kind, assignment.node, "edgesplit")

    def _ask(self, edges: list[_Assignment]) -> dict[str, tuple[str, int | None]]:
        """Offer each edge its blocks; return the refusals: device -> (reason, the memory
        budget it reported, when the refusal was about memory)."""
        messages = [self._message(a, ArrayRecord(), self._task(a), "query") for a in edges]
        replies = self.grid.send_and_receive(messages, timeout=60.0)
        answered: dict[int, Message] = {m.metadata.src_node_id: m for m in replies}
        refusals: dict[str, tuple[str, int | None]] = {}
        for assignment in edges:
            reply = answered.get(assignment.node)
            if reply is None:
                refusals[assignment.device] = ("did not answer the assignment within 60 s", None)
            elif reply.has_error():
                refusals[assignment.device] = (
                    f"failed on the assignment: {reply.error.reason}",
                    None,
                )
            else:
                metrics = reply.content.metric_records["metrics"]
                if not metrics["accepted"]:
                    reason = str(reply.content.config_records["answer"]["reason"])
                    budget = int(metrics["budget"])  # type: ignore[arg-type]
                    memory = budget if budget < assignment.estimate else None
                    refusals[assignment.device] = (reason, memory)
        return refusals

    def plan(
        self, edges: list[Announcement], servers: list[Announcement]
    ) -> tuple[Plan | None, list[_Assignment], list[_Assignment]]:
        """Plan, ask the edges, plan again around refusals; the edges' and server's blocks."""
        config = self.config
        partition = PartitionConfig(
            batch_size=config.training.batch_size,
            optimizer=config.training.optimizer.name,
            local_loss=config.training.local_loss,
            compression=config.training.compression,
        )
        log.info(
            "profiling %s at batch %d (fresh process)",
            config.model.name,
            config.training.batch_size,
        )
        profile = self._profile(config)
        candidates = list(edges)
        for _ in range(2 * len(edges) + 2):  # each pass drops an edge or lowers a budget
            specs = [
                DeviceSpec(a.device, "edge", a.memory, a.flops, a.uplink or 1e9) for a in candidates
            ] + [DeviceSpec(s.device, "gpu", s.memory, s.flops) for s in servers]
            plan = plan_split(profile, specs, partition)
            assigned = [
                _Assignment(e.name, 0, e.blocks[1], e.estimated_peak_bytes, "edge")
                for e in plan.edges
            ]
            refusals = self._ask(assigned)
            if not refusals:
                break
            for device, (reason, budget) in refusals.items():
                action = "planning without it" if budget is None else "planning with its budget"
                log.warning("edge %s refused its blocks: %s; %s", device, reason, action)
                self.refusals[device] = reason
                self.store.add_event(config.run_id, Event("assignment-refused", reason, device))
            replanned = []
            for candidate in candidates:
                if candidate.device not in refusals:
                    replanned.append(candidate)
                elif (budget := refusals[candidate.device][1]) is not None:
                    replanned.append(replace(candidate, memory=budget))
            candidates = replanned
            if len(candidates) < max(1, self.min_edges):
                raise CoordinatorError(
                    "too few edges accepted their blocks: "
                    + "; ".join(f"{d}: {r}" for d, r in self.refusals.items())
                )
        else:
            raise CoordinatorError(
                "the edges kept refusing their blocks: "
                + "; ".join(f"{d}: {r}" for d, r in self.refusals.items())
            )
        shallowest = min(a.end for a in assigned)
        return plan, assigned, self._servers(profile, servers, shallowest, plan)

    def _stored_plan(
        self, edges: list[Announcement], servers: list[Announcement]
    ) -> tuple[list[_Assignment], list[_Assignment]] | None:
        """A resumed run's stored plan, when the same devices are online, each still announces
        the memory its blocks need, and every edge accepts its blocks again; else None (plan
        anew). Keeping it keeps the cuts, so the local heads trained so far stay in use."""
        stored = self.store.get_run(self.config.run_id).plan
        if not stored:
            return None
        memory = {a.device: a.memory for a in [*edges, *servers]}
        assigned = [
            _Assignment(e["name"], 0, e["blocks"][1], e["estimated_peak_bytes"], "edge")
            for e in stored.get("edges", [])
        ]
        backs = [
            _Assignment(s["name"], s["blocks"][0], s["blocks"][1], s["estimated_peak_bytes"], "gpu")
            for s in stored.get("servers", [])
        ]
        kept = [*assigned, *backs]
        if sorted(a.device for a in kept) != sorted(memory):
            log.info("the devices online differ from the stored plan's: planning anew")
            return None
        short = [a.device for a in kept if memory[a.device] < a.estimate]
        if short:
            log.info("%s announce less memory than the stored plan needs: planning anew", short)
            return None
        refusals = self._ask(assigned)
        if refusals:
            log.info("edges refuse their stored blocks (%s): planning anew", sorted(refusals))
            return None
        log.info("resumed run %s keeps its stored plan", self.config.run_id)
        return assigned, backs

    def _servers(
        self, profile: ModelProfile, servers: list[Announcement], start: int, plan: Plan
    ) -> list[_Assignment]:
        """The GPU servers that hold the back from ``start``: every declared server with the
        memory for all of it (they share the edges' streams, one shared subscription, and
        their back replicas are aggregated like any other replicas); when none has, the plan's
        contiguous pieces, one server each, chained (each trains its piece with a local loss
        and passes its output on)."""
        config = self.config
        need = estimate_segment_memory(
            profile,
            start,
            profile.num_blocks,
            config.training.batch_size,
            config.training.optimizer.name,
        ).total
        fitting = [s for s in servers if s.memory >= need]
        if fitting:
            return [_Assignment(s.device, start, profile.num_blocks, need, "gpu") for s in fitting]
        pieces = [p for p in plan.servers if p.blocks[1] > start]
        if not pieces or pieces[0].blocks[0] > start or config.training.mode == "backprop":
            best = max(servers, key=lambda s: s.memory)
            why = (
                "; backprop mode needs one server to hold all of it"
                if config.training.mode == "backprop"
                else ""
            )
            raise InfeasiblePlanError(
                f"the back blocks [{start}, {profile.num_blocks}) need {format_bytes(need)}; "
                f"the largest GPU server {best.device!r} has {format_bytes(best.memory)}{why}"
            )
        log.info(
            "no GPU server holds the back alone: chaining %s",
            ", ".join(f"{p.name} [{p.blocks[0]}, {p.blocks[1]})" for p in pieces),
        )
        return [
            _Assignment(p.name, p.blocks[0], p.blocks[1], p.estimated_peak_bytes, "gpu")
            for p in pieces
        ]

    # ---------------------------------------------------------------- rounds
    def run(self) -> int:
        """Train the run to its configured rounds; return the number of rounds run now."""
        config, store = self.config, self.store
        try:
            run = store.get_run(config.run_id)
            for key in ("model", "input_shape", "num_classes"):
                if run.config.get(key) != config.to_dict()[key]:
                    raise ConfigError(
                        f"run {config.run_id!r} exists with {key} {run.config.get(key)!r}; "
                        f"this config has {config.to_dict()[key]!r} (use a new run_id)"
                    )
            log.info("resuming run %s after round %s", config.run_id, run.current_round or 0)
        except NotFoundError:
            store.create_run(config.run_id, config.to_dict(), config.training.seed)
        # Before any message: devices still inside a round of a crashed predecessor give it up.
        self.transport.publish(topics.coordinator(config.run_id), self.session.encode(), True)
        resumed = store.resume(config.run_id)
        done = 0 if resumed is None else resumed.round.number
        if done >= config.training.rounds:
            store.set_run_status(config.run_id, "finished")
            log.info("run %s already has all %d rounds", config.run_id, config.training.rounds)
            return 0
        store.set_run_status(config.run_id, "planning")
        try:
            edges, servers = self.wait_for_devices()
            kept = None if resumed is None else self._stored_plan(edges, servers)
            if kept is not None:
                plan, (assigned, backs) = None, kept
            else:
                plan, assigned, backs = self.plan(edges, servers)
        except (CoordinatorError, SplitError) as error:
            store.set_run_status(config.run_id, "failed")
            store.add_event(config.run_id, Event("planning-failed", str(error)))
            raise
        if plan is not None:
            stored = plan.to_dict()
            memory = {s.device: s.memory for s in servers}
            stored["servers"] = [
                {
                    "name": back.device,
                    "blocks": [back.start, back.end],
                    "estimated_peak_bytes": back.estimate,
                    "budget_bytes": memory[back.device],
                }
                for back in backs
            ]
            store.set_plan(config.run_id, stored)
            log.info("plan:\n%s", plan)
        cuts = [a.end for a in assigned] + [
            b.end for b in backs if b.end < max(b.end for b in backs)
        ]
        weights = initial_weights(
            config.model.name,
            config.model.input_shape,
            config.model.num_classes,
            config.training.local_loss,
            cuts,
            config.training.seed,
        )
        if resumed is not None:
            weights |= resumed.weights[WEIGHTS_SEGMENT]
        store.set_run_status(config.run_id, "training")
        for number in range(done + 1, config.training.rounds + 1):
            weights = self._round(number, weights, assigned, backs)
        store.set_run_status(config.run_id, "finished")
        return config.training.rounds - done

    def _selected(
        self, number: int, assigned: list[_Assignment], weights: dict[str, np.ndarray]
    ) -> list[_Assignment]:
        by_node = {a.node: a for a in assigned}
        online = set(self.grid.get_node_ids())
        view = _EdgeView(self.grid, lambda: sorted(n for n in by_node if n in online))
        if not view.get_node_ids():
            return []
        random.seed(self.config.training.seed * 100_003 + number)
        sampled = self.strategy.configure_train(number, array_record(weights), ConfigRecord(), view)
        return [by_node[m.metadata.dst_node_id] for m in sampled]

    def _round(
        self,
        number: int,
        weights: dict[str, np.ndarray],
        assigned: list[_Assignment],
        backs: list[_Assignment],
    ) -> dict[str, np.ndarray]:
        config, store = self.config, self.store
        for attempt in range(1, self.max_attempts + 1):
            started = time.monotonic()
            self.observer.round_starting(number)
            selected = self._selected(number, assigned, weights)
            names = [a.device for a in selected]
            online = set(self.grid.get_node_ids())
            servers = [b for b in backs if b.node in online]
            store.open_round(config.run_id, number, [*names, *(b.device for b in servers)])
            missing = sorted({_span(b) for b in backs} - {_span(b) for b in servers})
            if len(selected) < self.min_edges or missing:
                reason = (
                    f"no GPU server holding blocks {', '.join(map(str, missing))} is online"
                    if missing
                    else f"{len(selected)} edge(s) online, {self.min_edges} needed"
                )
                self._attempt_failed(number, attempt, reason)
                time.sleep(min(10.0, config.training.round_deadline_seconds / 10))
                continue
            streams, routes = _route(selected, servers)
            messages = {
                a.device: self._message(
                    a,
                    array_record(_keys_for(weights, 0, a.end, a.end)),
                    self._task(a, segment=streams[a.device]),
                    "train",
                    number,
                )
                for a in selected
            }
            last = max(b.end for b in backs)
            for back in servers:
                senders, peers, segment, forward = routes[back.device]
                if not senders:
                    continue  # nothing streams into this piece this round
                head = back.end if back.end < last else None
                messages[back.device] = self._message(
                    back,
                    array_record(_keys_for(weights, back.start, back.end, head)),
                    self._task(back, senders, peers, segment, forward),
                    "train",
                    number,
                )
            server_names = [b.device for b in servers if b.device in messages]
            self.observer.round_started(number, list(messages))
            replies = self._collect(messages, config.training.round_deadline_seconds)
            results, ok, traffic = self._results(messages, replies, started)
            edges_ok = [d for d in ok if d not in server_names]
            spans = {_span(b) for b in servers if b.device in messages}
            spans_ok = {_span(b) for b in servers if b.device in ok}
            if spans and spans_ok == spans and len(edges_ok) >= self.min_edges:
                arrays, _ = self.strategy.aggregate_train(number, [replies[d] for d in sorted(ok)])
                if arrays is None:
                    self._attempt_failed(number, attempt, "the strategy aggregated nothing")
                    continue
                merged = {k: v.numpy() for k, v in arrays.items()}
                evaluation = (
                    evaluate_weights(
                        config.model.name,
                        config.model.input_shape,
                        config.model.num_classes,
                        merged,
                        self.eval_data,
                    )
                    if self.eval_data is not None
                    else {}
                )
                if config.training.federated_eval > 0:
                    trained = [a for a in selected if a.device in edges_ok]
                    evaluation |= self._federated_evaluation(number, merged, trained)
                self._commit(number, merged, results, traffic, evaluation, started, server_names)
                return merged
            store.record_results(config.run_id, number, results)
            failed = [f"{r.device}: {r.failure}" for r in results if r.failure]
            self._attempt_failed(number, attempt, "; ".join(failed) or "not enough replies")
        store.set_run_status(config.run_id, "failed")
        raise CoordinatorError(
            f"round {number} failed {self.max_attempts} times; see `edgesplit status --run "
            f"{config.run_id}` and the run's events"
        )

    def _federated_evaluation(
        self, number: int, weights: dict[str, np.ndarray], edges: list[_Assignment]
    ) -> dict[str, float]:
        """The assembled model evaluated by ``edges`` on the data they hold out: accuracy and
        loss weighted by their examples (keys ``federated_*``); edges that do not answer in
        time are left out."""
        arrays = array_record(weights)
        messages = {
            a.device: self._message(a, arrays, self._task(a), "evaluate", number) for a in edges
        }
        replies = self._collect(
            messages, self.config.training.round_deadline_seconds / 2, observed=False
        )
        totals = {"examples": 0.0, "accuracy": 0.0, "loss": 0.0}
        for device, reply in replies.items():
            if reply.has_error():
                log.warning("federated evaluation on %s failed: %s", device, reply.error.reason)
                continue
            metrics = reply.content.metric_records["metrics"]
            count = float(metrics["num-examples"])  # type: ignore[arg-type]
            totals["examples"] += count
            totals["accuracy"] += count * float(metrics["accuracy"])  # type: ignore[arg-type]
            totals["loss"] += count * float(metrics["loss"])  # type: ignore[arg-type]
        if not totals["examples"]:
            return {}
        return {
            "federated_accuracy": totals["accuracy"] / totals["examples"],
            "federated_loss": totals["loss"] / totals["examples"],
            "federated_examples": totals["examples"],
        }

    def _attempt_failed(self, number: int, attempt: int, reason: str) -> None:
        log.warning("round %d attempt %d/%d failed: %s", number, attempt, self.max_attempts, reason)
        self.store.add_event(self.config.run_id, Event("round-failed", reason, round=number))

    def _collect(
        self, messages: dict[str, Message], deadline: float, observed: bool = True
    ) -> dict[str, Message]:
        """Replies by device, until all came, the deadline passed, or every device still
        missing is offline (its last will arrived)."""
        ids = dict(zip(self.grid.push_messages(messages.values()), messages, strict=True))
        nodes = {device: node_id_for(device) for device in messages}
        replies: dict[str, Message] = {}
        until = time.monotonic() + deadline
        while len(replies) < len(messages) and time.monotonic() < until:
            for reply in self.grid.pull_messages([i for i, d in ids.items() if d not in replies]):
                replies[ids[reply.metadata.reply_to_message_id]] = reply
                if observed:
                    self.observer.device_answered(ids[reply.metadata.reply_to_message_id])
            waiting = [d for d in messages if d not in replies]
            online = set(self.grid.get_node_ids())
            if waiting and not any(nodes[d] in online for d in waiting):
                break
            time.sleep(_POLL)
        self.grid.abandon([i for i, d in ids.items() if d not in replies])
        return replies

    def _results(
        self, messages: dict[str, Message], replies: dict[str, Message], started: float
    ) -> tuple[list[DeviceResult], list[str], dict[str, dict[str, float]]]:
        """Each device's result, the devices that trained, and their cut-layer bytes."""
        online = set(self.grid.get_node_ids())
        results, ok = [], []
        traffic: dict[str, dict[str, float]] = {}  # cut-layer bytes by device
        for device in messages:
            reply = replies.get(device)
            if reply is None:
                why = "no reply before the deadline" if node_id_for(device) in online else "offline"
                results.append(DeviceResult(device, failure=why))
                continue
            if reply.has_error():
                results.append(DeviceResult(device, failure=(reply.error.reason or "failed")[:500]))
                continue
            metrics = reply.content.metric_records["metrics"]
            traffic[device] = {
                name.replace("-", "_"): float(metrics[name])  # type: ignore[arg-type]
                for name in ("cut-bytes-sent", "cut-bytes-received")
                if name in metrics
            }
            peak = int(metrics.get("peak-memory", -1))  # type: ignore[arg-type]
            loss = float(metrics.get("loss", math.nan))  # type: ignore[arg-type]
            results.append(
                DeviceResult(
                    device,
                    examples=int(metrics["num-examples"]),  # type: ignore[arg-type]
                    loss=loss if math.isfinite(loss) else None,
                    bytes_sent=int(metrics.get("bytes-sent", 0)),  # type: ignore[arg-type]
                    bytes_received=int(metrics.get("bytes-received", 0)),  # type: ignore[arg-type]
                    wall_seconds=float(metrics.get("wall-seconds", time.monotonic() - started)),  # type: ignore[arg-type]
                    peak_memory_bytes=peak if peak >= 0 else None,
                )
            )
            ok.append(device)
        return results, ok, traffic

    def _commit(
        self,
        number: int,
        weights: dict[str, np.ndarray],
        results: list[DeviceResult],
        traffic: Mapping[str, Mapping[str, float]],
        evaluation: dict[str, float],
        started: float,
        servers: Sequence[str],
    ) -> None:
        config, store = self.config, self.store
        store.record_results(config.run_id, number, results)
        trained = [r for r in results if not r.failure]
        metrics = {
            "wall_seconds": time.monotonic() - started,
            "participants_ok": float(len(trained)),
            "examples": float(sum(r.examples for r in trained if r.device not in servers)),
        }
        points = [
            MetricPoint("peak_memory_bytes", float(r.peak_memory_bytes), number, r.device)
            for r in results
            if r.peak_memory_bytes is not None
        ]
        points += [
            MetricPoint(name, value, number, r.device)
            for r in trained
            for name, value in traffic.get(r.device, {}).items()
        ]
        if points:
            store.add_metrics(config.run_id, points)
        store.commit_round(
            config.run_id,
            number,
            {WEIGHTS_SEGMENT: weights},
            metrics=metrics,
            evaluation=evaluation,
        )
        self.observer.round_committed(number, evaluation, results)
        failed = ", ".join(f"{r.device} ({r.failure})" for r in results if r.failure)
        log.info(
            "round %d/%d committed: %s, %d device(s) trained%s, %.1f s",
            number,
            config.training.rounds,
            ", ".join(f"{k} {v:.4f}" for k, v in evaluation.items()) or "no eval data",
            len(trained),
            f", without {failed}" if failed else "",
            metrics["wall_seconds"],
        )


def _profile_fresh(config: RunConfig) -> ModelProfile:
    return profile_in_fresh_process(
        config.model.name,
        config.model.input_shape,
        config.model.num_classes,
        (config.training.local_loss,),
        config.training.batch_size,
    )
