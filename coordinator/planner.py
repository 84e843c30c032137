"""Planning a run onto its devices: plan, offer each edge its blocks, re-plan around refusals,
place the back on the GPU servers, or keep a resumed run's stored plan.

The plan stored in the run is a :class:`~split_models.plan.Plan` whose ``servers`` are the GPU
server replicas the rounds use (every server holding the whole back, or the chained pieces).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from flwr.app import ArrayRecord, Message

from coordinator.assignments import Assignment, build_message, build_task
from coordinator.config import RunConfig
from coordinator.errors import CoordinatorError, PlanRefused
from coordinator.partitioner import PartitionConfig, place_back, plan_split
from split_models.config import config_to_dict
from split_models.data import batch_count, trained_examples
from split_models.devices import DeviceSpec
from split_models.errors import ConfigError, InfeasiblePlanError
from split_models.memory import estimate_segment_memory
from split_models.plan import Plan, ServerAssignment
from split_models.profiler import ModelProfile
from split_models.units import format_bytes
from storage.base import RunStore
from storage.records import Event, RunRecord
from wire.flower import TransportGrid
from wire.logs import printable
from wire.roles import Announcement

__all__ = [
    "MEASURED_KEY",
    "Placement",
    "Planner",
    "device_specs",
    "profile_key",
    "refused_error",
    "stored_plan",
]

log = logging.getLogger(__name__)
# beside a stored plan: the speeds it was made with, when measured (coordinator.speed)
MEASURED_KEY = "measured"
CUTS_KEY = "cuts"  # beside a stored plan: devices.cuts when it was made
_ASK_TIMEOUT = 60.0
Refusals = dict[str, tuple[str, int | None]]


@dataclass(frozen=True)
class Placement:
    """The edges' and GPU servers' blocks of a run, and the plan they came from."""

    plan: Plan
    edges: list[Assignment]
    servers: list[Assignment]

    def spans(self) -> dict[str, tuple[int, int, int | None]]:
        """Each device's blocks ``[start, end)`` and the cut of the local head it trains
        (None: the last blocks, trained on the task's loss)."""
        last = self.plan.num_blocks
        return {
            a.device: (a.start, a.end, a.end if a.end < last else None)
            for a in [*self.edges, *self.servers]
        }


def _edges_of(plan: Plan) -> list[Assignment]:
    return [Assignment(e.name, 0, e.blocks[1], e.estimated_peak_bytes, "edge") for e in plan.edges]


def _servers_of(plan: Plan) -> list[Assignment]:
    return [
        Assignment(s.name, s.blocks[0], s.blocks[1], s.estimated_peak_bytes, "gpu")
        for s in plan.servers
    ]


def profile_key(config: RunConfig) -> dict[str, Any]:
    """What a run's model profile depends on, as stored beside it (JSON types)."""
    key = {
        "model": config_to_dict(config.model),
        "batch_size": config.training.batch_size,
        "local_loss": config.training.local_loss,
    }
    return json.loads(json.dumps(key))  # type: ignore[no-any-return]


def stored_plan(run: RunRecord) -> Plan | None:
    """The plan stored in ``run``, or None when it has none (a malformed one raises
    :class:`~split_models.errors.ConfigError`)."""
    if not run.plan:
        return None
    return Plan.from_dict({k: v for k, v in run.plan.items() if k not in (MEASURED_KEY, CUTS_KEY)})


class Planner:
    """Plans ``config`` for the devices that announced themselves."""

    def __init__(
        self,
        config: RunConfig,
        store: RunStore,
        grid: TransportGrid,
        session: str,
        profile: Callable[[RunConfig], ModelProfile],
        min_edges: int,
    ) -> None:
        self.config, self.store, self.grid, self.session = config, store, grid, session
        self._profile, self.min_edges = profile, min_edges
        self.refusals: dict[str, str] = {}
        # edges that timed the blocks they accepted (undeclared speeds): their reply metrics
        self.timed: dict[str, dict[str, Any]] = {}

    def ask(self, edges: list[Assignment]) -> Refusals:
        """Offer each edge its blocks; return the refusals: device -> (reason, the memory
        budget it reported, when the refusal was about memory)."""
        messages = [
            build_message(
                self.grid,
                a.node,
                ArrayRecord(),
                "query",
                task=build_task(self.config, a, self.session),
            )
            for a in edges
        ]
        replies = self.grid.send_and_receive(messages, timeout=_ASK_TIMEOUT)
        answered: dict[int, Message] = {m.metadata.src_node_id: m for m in replies}
        refusals: Refusals = {}
        for assignment in edges:
            reply = answered.get(assignment.node)
            if (refusal := _refusal(assignment, reply)) is not None:
                refusals[assignment.device] = refusal
            elif reply is not None and "compute-seconds" in reply.content.metric_records["metrics"]:
                metrics = reply.content.metric_records["metrics"]  # checked where it is used
                self.timed[assignment.device] = dict(metrics)
        return refusals

    def plan(self, edges: list[Announcement], servers: list[Announcement]) -> Placement:
        """Plan, ask the edges, plan again around refusals; the edges' and servers' blocks."""
        partition, profile = self.partition(), self.profile()
        candidates, refused = list(edges), set[str]()
        for _ in range(2 * len(edges) + 2):  # each pass drops an edge or lowers a budget
            candidates = self._fitting(candidates, servers, profile)
            specs = device_specs(candidates, servers, self.per_round())
            placed = self.offer(plan_split(profile, specs, partition), servers)
            if isinstance(placed, Placement):
                return placed
            candidates = self._around(candidates, placed, refused)
            refused |= set(placed)
        raise refused_error("the edges kept refusing their blocks", self.refusals)

    def offer(self, plan: Plan, servers: list[Announcement]) -> Placement | Refusals:
        """Offer ``plan``'s edges their blocks: the placement (the back on ``servers``) when
        every edge accepts, else the refusals."""
        assigned = _edges_of(plan)
        refusals = self.ask(assigned)
        if refusals:
            return refusals
        backs = self._servers(self.profile(), servers, min(a.end for a in assigned), plan.servers)
        memory = {s.device: s.memory for s in servers}
        return Placement(_with_servers(plan, backs, memory), assigned, backs)

    def move_back(self, placement: Placement, servers: list[Announcement]) -> Placement:
        """``placement`` with its back on ``servers`` (those online now) and the edges' cuts
        kept, so the edges are not asked again: a chain that lost a server is placed anew.
        Raises :class:`InfeasiblePlanError` when ``servers`` cannot hold the back."""
        profile, start = self.profile(), min(a.end for a in placement.edges)
        try:
            pieces = place_back(profile, device_specs([], servers), self.partition(), start)
        except InfeasiblePlanError:  # not even in pieces: the shortfall in all
            if self.config.training.mode != "backprop":
                raise
            pieces = ()  # one server must hold it all: _servers names the largest
        backs = self._servers(profile, servers, start, pieces)
        memory = {s.device: s.memory for s in servers}
        return Placement(_with_servers(placement.plan, backs, memory), placement.edges, backs)

    def record(self, plan: Plan) -> dict[str, Any]:
        """``plan`` as the store keeps it, with what it was made for beside it."""
        return plan.to_dict() | {CUTS_KEY: self.config.devices.cuts}

    def partition(self) -> PartitionConfig:
        """What the partitioner needs of the run's training config."""
        training = self.config.training
        return PartitionConfig(
            batch_size=training.batch_size,
            optimizer=training.optimizer.name,
            local_loss=training.local_loss,
            compression=training.compression,
            cuts=self.config.devices.cuts,
            anchor=self.config.aggregation.anchors,
            mode=training.mode,
        )

    def per_round(self) -> tuple[int, int, float]:
        """The batch size, local epochs and share held out for federated evaluation: an
        edge's batches a round, with its announced examples."""
        training = self.config.training
        return training.batch_size, training.local_epochs, training.federated_eval

    def profile(self) -> ModelProfile:
        """The run's stored profile when it was measured for today's model, batch size and
        local loss (a restart that re-plans does not profile again), else a new one, stored."""
        config, key = self.config, profile_key(self.config)
        if (stored := _stored_profile(self.store, config.run_id, key)) is not None:
            log.info("using the run's stored profile of %s", config.model.name)
            return stored
        log.info(
            "profiling %s at batch %d (a fresh process, or the profile cache)",
            config.model.name,
            config.training.batch_size,
        )
        profile = self._profile(config)
        self.store.set_profile(config.run_id, {"key": key, "profile": profile.to_dict()})
        return profile

    def _fitting(
        self, candidates: list[Announcement], servers: list[Announcement], profile: ModelProfile
    ) -> list[Announcement]:
        """The ``candidates`` whose memory holds their smallest segment: the others (a device
        too small for this model, or one announcing a budget it knows fits nothing) are left
        out, each with an event, unless too few would be left (then the plan names them all)."""
        specs = device_specs(candidates, servers, self.per_round())
        unfit, line = unfit_edges(profile, specs, self.partition())
        fitting = [c for c in candidates if c.device not in unfit]
        if not unfit or len(fitting) < max(1, self.min_edges):
            return candidates
        log.warning("left out of the plan: %s", line)
        for device, why in unfit.items():
            self.store.add_event(self.config.run_id, Event("edge-unfit", why, device))
        return fitting

    def _around(
        self, candidates: list[Announcement], refusals: Refusals, refused: set[str]
    ) -> list[Announcement]:
        """The edges to plan with next: refusers without a budget, or refusing a second time
        (``refused``: those that refused before; a budget it reported was planned for), are
        dropped, the others have the budget they reported; each refusal is logged and stored
        as an event."""
        for device, (reason, budget) in refusals.items():
            again = device in refused
            action = (
                "planning without it" if budget is None or again else "planning with its budget"
            )
            said = "did not take" if reason.startswith("did not answer") else "refused"
            log.warning("edge %s %s its blocks: %s; %s", device, said, reason, action)
            self.refusals[device] = reason
            self.store.add_event(self.config.run_id, Event("assignment-refused", reason, device))
        replanned = []
        for candidate in candidates:
            if candidate.device not in refusals:
                replanned.append(candidate)
            elif (budget := refusals[candidate.device][1]) is not None and (
                candidate.device not in refused
            ):
                replanned.append(replace(candidate, memory=budget))
        if len(replanned) < max(1, self.min_edges):
            raise refused_error("too few edges accepted their blocks", self.refusals)
        return replanned

    def stored(self, edges: list[Announcement], servers: list[Announcement]) -> Placement | None:
        """A resumed run's stored plan, when the same devices are online, each still announces
        the memory its blocks need, and every edge accepts its blocks again; else None (plan
        anew). Keeping it keeps the cuts, so the local heads trained so far stay in use."""
        run = self.store.get_run(self.config.run_id)
        try:
            plan = stored_plan(run)
        except ConfigError as error:
            log.info("the stored plan is unreadable (%s): planning anew", error)
            return None
        if plan is None:
            return None
        memory = {a.device: a.memory for a in [*edges, *servers]}
        assigned, backs = _edges_of(plan), _servers_of(plan)
        kept = [*assigned, *backs]
        if sorted(a.device for a in kept) != sorted(memory):
            log.info("the devices online differ from the stored plan's: planning anew")
            return None
        made_for = (run.plan or {}).get(CUTS_KEY, "per-device")
        if made_for != self.config.devices.cuts:
            log.info("the stored plan was made for cuts: %s: planning anew", made_for)
            return None
        short = [a.device for a in kept if memory[a.device] < a.estimate]
        if short:
            log.info("%s announce less memory than the stored plan needs: planning anew", short)
            return None
        refusals = self.ask(assigned)
        if refusals:
            log.info("edges refuse their stored blocks (%s): planning anew", sorted(refusals))
            return None
        log.info("resumed run %s keeps its stored plan", self.config.run_id)
        return Placement(plan, assigned, backs)

    def _servers(
        self,
        profile: ModelProfile,
        servers: list[Announcement],
        start: int,
        planned: Sequence[ServerAssignment],
    ) -> list[Assignment]:
        """The GPU servers that hold the back from ``start``: every declared server with the
        memory for all of it (they share the edges' streams, one shared subscription, and
        their back replicas are aggregated like any other replicas); when none has, the plan's
        contiguous pieces, one server each, chained (each trains its piece with a local loss
        and passes its output on), ``planned`` by the partitioner."""
        config = self.config
        need = estimate_segment_memory(
            profile,
            start,
            profile.num_blocks,
            config.training.batch_size,
            config.training.optimizer.name,
            config.training.local_loss,
            config.aggregation.anchors,
        ).total
        fitting = [s for s in servers if s.memory >= need]
        if fitting:
            return [Assignment(s.device, start, profile.num_blocks, need, "gpu") for s in fitting]
        pieces = [p for p in planned if p.blocks[1] > start]
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
            Assignment(p.name, p.blocks[0], p.blocks[1], p.estimated_peak_bytes, "gpu")
            for p in pieces
        ]


def _answer(reply: Message) -> tuple[bool, int, str] | None:
    """An edge's answer to an assignment: accepted, its budget, why it refused; None when
    the reply is malformed (a device may send anything)."""
    metrics = reply.content.metric_records.get("metrics")
    answer = reply.content.config_records.get("answer")
    if metrics is None or answer is None:
        return None
    accepted, budget, reason = metrics.get("accepted"), metrics.get("budget"), answer.get("reason")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in (accepted, budget)):
        return None
    return bool(accepted), max(0, int(budget)), printable(reason)  # type: ignore[arg-type]


def _stored_profile(store: RunStore, run_id: str, key: dict[str, Any]) -> ModelProfile | None:
    """The profile ``store`` keeps for ``run_id`` when it was measured for ``key``."""
    document = store.get_profile(run_id)
    if document is None or document.get("key") != key:
        return None
    try:
        return ModelProfile.from_dict(document["profile"])
    except (KeyError, TypeError, ValueError) as error:
        log.info("the stored profile is unreadable (%s): profiling anew", error)
        return None


def refused_error(what: str, refusals: Mapping[str, str]) -> CoordinatorError:
    """The error of a plan the edges would not take, naming each of ``refusals``:
    :class:`PlanRefused` when every edge answered (a config they refuse), else a
    :class:`CoordinatorError` (one that did not answer may answer later)."""
    said = "; ".join(f"{d}: {r}" for d, r in refusals.items())
    silent = any(r.startswith("did not answer") for r in refusals.values())
    return (CoordinatorError if silent else PlanRefused)(f"{what}: {said}")


def _refusal(assignment: Assignment, reply: Message | None) -> tuple[str, int | None] | None:
    """Why ``assignment``'s edge refused it with ``reply`` and the memory budget it reported
    (None when it named none below the estimate), or None: it accepted."""
    if reply is None:
        return f"did not answer the assignment within {_ASK_TIMEOUT:.0f} s", None
    if reply.has_error():
        return f"failed on the assignment: {printable(reply.error.reason)}", None
    if (answer := _answer(reply)) is None:
        return "sent a malformed answer to the assignment", None
    if not answer[0]:
        return answer[2], answer[1] if answer[1] < assignment.estimate else None
    return None


def unfit_edges(
    profile: ModelProfile, specs: list[DeviceSpec], partition: PartitionConfig
) -> tuple[dict[str, str], str]:
    """The edges among ``specs`` that cannot hold even their smallest segment, each with the
    partitioner's reason, and one line saying it of them all (edges of one memory share a
    reason); none when the servers among ``specs`` cannot hold the back anyway."""
    backs = [s for s in specs if s.kind == "gpu"]
    reasons: dict[int, tuple[str, str | None]] = {}  # by memory: one edge planned of each
    unfit: dict[str, str] = {}
    for spec in (s for s in specs if s.kind == "edge"):
        if spec.memory not in reasons:
            try:
                plan_split(profile, [spec, *backs], partition)
                reasons[spec.memory] = spec.name, None
            except InfeasiblePlanError as error:
                reasons[spec.memory] = spec.name, str(error)
        first, why = reasons[spec.memory]
        if why is not None:  # the partitioner's reason, which names its edge so
            said = why.replace(f"edge {first!r}", f"edge {spec.name!r}")
            unfit[spec.name] = f"left out of the plan: {said}"
    line = ""
    if unfit:
        try:  # one line for all of them
            plan_split(profile, [*(s for s in specs if s.name in unfit), *backs], partition)
        except InfeasiblePlanError as error:
            line = str(error)
    return unfit, line


def device_specs(
    edges: list[Announcement],
    servers: list[Announcement],
    per_round: tuple[int, int, float] = (0, 1, 0.0),
) -> list[DeviceSpec]:
    """The partitioner's view of the announced ``edges`` and ``servers``; ``per_round``: the
    batch size, local epochs and federated evaluation's held-out share that an edge's
    announced examples make its batches a round by (batch size 0: not counted)."""
    batch, epochs, held_out = per_round
    return [
        DeviceSpec(
            a.device,
            "edge",
            a.memory,
            a.flops,
            a.uplink or 1e9,
            epochs * batch_count(trained_examples(a.examples or 0, held_out), batch)
            if batch
            else 0,
        )
        for a in edges
    ] + [DeviceSpec(s.device, "gpu", s.memory, s.flops) for s in servers]


def _with_servers(plan: Plan, backs: list[Assignment], memory: dict[str, int]) -> Plan:
    """``plan`` with the GPU server replicas the rounds use as its servers."""
    servers = tuple(
        ServerAssignment(b.device, (b.start, b.end), b.estimate, memory[b.device]) for b in backs
    )
    return replace(plan, servers=servers)
