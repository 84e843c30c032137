"""Re-planning from measured speeds.

A device declares its FLOP/s when it announces itself, and the plan's cuts follow from it.
Declared speeds are guesses (a datasheet's peak, or a phone that throttles), so every device
also reports what its round's training steps took (``split_models.timing``: seconds, and
examples per cut). With the profile's FLOPs per sample, the numbers the partitioner plans
with, that is a speed in the planner's own units: the FLOP/s at which its cost model gives
the measured step time.

After a committed round, when a device's measured speed is off the speed the plan used by
more than ``devices.replan_drift`` (0.25: 25 %), the coordinator plans again with the
measured speeds. The new plan is used (offered to the edges, stored as a new plan version)
when its predicted step is at least :data:`MIN_GAIN` shorter than the current plan's under
the same speeds; either way an event says what was measured. Re-plans from speeds are
:data:`REPLAN_SPACING` rounds apart at least. A device that lies about its timing moves
other edges' cuts too, as a false declaration would (the slowest edge sets the round time the
others fill); what it reports is validated like any other metric, and an edge refusing the
new plan keeps the current one.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from coordinator.assignments import span
from coordinator.errors import CoordinatorError
from coordinator.partitioner import TRAIN_FLOPS_FACTOR, Problem, plan_split, step_seconds
from coordinator.planner import MEASURED_KEY, Placement, Planner, device_specs
from split_models.cpu import MIN_SHARE
from split_models.errors import SplitError
from split_models.plan import Plan
from split_models.profiler import ModelProfile
from split_models.units import format_bytes
from storage.base import RunStore
from storage.records import Event
from wire.roles import Announcement

__all__ = [
    "MIN_GAIN",
    "MIN_LINK_SECONDS",
    "MIN_STEP_SECONDS",
    "REPLAN_SPACING",
    "Replanner",
    "Timed",
    "drifted",
    "measured_speeds",
    "speed",
    "timed_link",
    "timed_work",
]

log = logging.getLogger(__name__)
MIN_GAIN = 0.10  # a new plan must predict a step this much shorter to replace the current one
# rounds between two re-plans from speeds: a device that reports a new speed every round (a
# liar, or a noisy one) cannot have the edges' cuts, and their fresh heads, change every round
REPLAN_SPACING = 3
# Steps shorter than this on average are mostly framework overhead (a few ms of Python and
# kernel launches a step), not FLOPs: their rate says little of the device, so it is not used.
MIN_STEP_SECONDS = 0.010
MIN_LINK_SECONDS = 0.05  # transfers measured in a round, in all, before an uplink counts
_MAX_CUTS = 1024  # a GPU server's timing names at most this many cuts
_MIN_SECONDS, _MAX_SECONDS = 1e-6, 7 * 24 * 3600.0


@dataclass(frozen=True)
class Timed:
    """A device's timed training steps of one round: seconds, and examples per cut."""

    seconds: float
    examples: Mapping[int, int]
    steps: int = 1
    # the steps' CPU seconds and the share of their demand the device's CPU quota allows
    # (split_models.cpu): None, 1.0 from a device that does not report them
    cpu_seconds: float | None = None
    share: float = 1.0


def timed_work(metrics: Mapping[str, Any]) -> Timed | None:
    """The timing a device reported in its reply ``metrics`` (None: it reported none);
    :class:`ValueError` naming what is wrong when it is malformed."""
    if "compute-seconds" not in metrics:
        return None
    seconds, cuts, examples, steps = (
        metrics.get(k)
        for k in ("compute-seconds", "compute-cuts", "compute-examples", "compute-steps")
    )
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ValueError(f"compute-seconds {seconds!r}: expected a number")
    if not _MIN_SECONDS <= seconds < _MAX_SECONDS:
        raise ValueError(
            f"compute-seconds {seconds!r}: expected in [{_MIN_SECONDS}, {_MAX_SECONDS:.0f})"
        )
    if not (isinstance(cuts, list) and isinstance(examples, list)) or len(cuts) != len(examples):
        raise ValueError("compute-cuts and compute-examples: expected two lists of one length")
    if not 0 < len(cuts) <= _MAX_CUTS:
        raise ValueError(f"compute-cuts: {len(cuts)} cuts, expected 1 to {_MAX_CUTS}")
    if not all(_count(v) for v in [*cuts, *examples]) or len(set(cuts)) != len(cuts):
        raise ValueError("compute-cuts and compute-examples: expected distinct cuts and counts")
    if not _count(steps) or not 0 < steps <= sum(examples):  # type: ignore[operator]
        raise ValueError(f"compute-steps {steps!r}: expected 1 to the examples timed")
    cpu, share = _cpu_timing(metrics)
    examples_by_cut = dict(zip(cuts, examples, strict=True))
    return Timed(float(seconds), examples_by_cut, int(steps), cpu, share)  # type: ignore[arg-type]


def _cpu_timing(metrics: Mapping[str, Any]) -> tuple[float | None, float]:
    """``compute-cpu-seconds`` and ``cpu-share`` (None, 1.0 when not reported)."""
    cpu, share = metrics.get("compute-cpu-seconds"), metrics.get("cpu-share", 1.0)
    if cpu is not None and (
        isinstance(cpu, bool)
        or not isinstance(cpu, int | float)
        or not _MIN_SECONDS <= cpu < _MAX_SECONDS
    ):
        raise ValueError(
            f"compute-cpu-seconds {cpu!r}: expected in [{_MIN_SECONDS}, {_MAX_SECONDS:.0f})"
        )
    if isinstance(share, bool) or not isinstance(share, int | float) or not MIN_SHARE <= share <= 1:
        raise ValueError(f"cpu-share {share!r}: expected a number in [{MIN_SHARE}, 1]")
    return (None if cpu is None else float(cpu)), float(share)


def timed_link(metrics: Mapping[str, Any]) -> float | None:
    """An edge's measured uplink in bytes/s from its reply ``metrics`` (None: it measured
    none, or too little to tell); :class:`ValueError` when malformed."""
    if "uplink-seconds" not in metrics:
        return None
    seconds, size = metrics.get("uplink-seconds"), metrics.get("uplink-bytes")
    if isinstance(seconds, bool) or not isinstance(seconds, int | float):
        raise ValueError(f"uplink-seconds {seconds!r}: expected a number")
    if not _MIN_SECONDS <= seconds < _MAX_SECONDS or not _count(size) or not size:
        raise ValueError(f"uplink-seconds {seconds!r} and uplink-bytes {size!r}: out of range")
    rate = size / seconds
    if rate < 1.0:  # as announcements: under a byte a second is not a link
        raise ValueError(f"uplink-bytes {size!r} in {seconds!r} s: under 1 byte/s")
    return rate if seconds >= MIN_LINK_SECONDS else None


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 1 << 40


def speed(timed: Timed, work: np.ndarray) -> float:
    """FLOP/s of ``timed`` steps, ``work[c]`` the forward FLOPs/sample of a batch at cut c;
    :class:`ValueError` for a cut outside ``work`` or no example."""
    total = 0.0
    for cut, examples in timed.examples.items():
        if not 0 < cut < len(work):
            raise ValueError(f"compute-cuts: cut {cut} is not one of the model's (1..)")
        total += examples * float(work[cut])
    if total <= 0:
        raise ValueError("compute-examples: no example trained in the timed steps")
    rate = TRAIN_FLOPS_FACTOR * total / timed.seconds
    if timed.cpu_seconds is None:
        return rate
    # under a CPU quota, steps timed while the device waited on its link ran at full speed;
    # what it sustains is its rate on the CPU times the share the quota allows (never more
    # than the wall clock says: a device cannot raise its speed by what it reports here)
    return min(rate, TRAIN_FLOPS_FACTOR * total / timed.cpu_seconds * timed.share)


def measured_speeds(
    plan: Plan, problem: Problem, timed: Mapping[str, Timed]
) -> tuple[dict[str, float], dict[str, str], dict[str, float]]:
    """The measured FLOP/s of the plan's edges and of its servers holding the whole back
    (a chained piece's work per sample is not the profile's), and why others' timing is
    unusable (device -> reason): a cut the plan did not give it (an edge has its own, a
    server the edges'). Third, floors: devices whose steps took under
    :data:`MIN_STEP_SECONDS` on average are mostly overhead, so their rate is only a floor
    of their speed (the overhead is in the seconds, not in the FLOPs)."""
    speeds: dict[str, float] = {}
    floors: dict[str, float] = {}
    bad: dict[str, str] = {}
    cuts = {e.blocks[1] for e in plan.edges}
    works = {e.name: (problem.edge_flops, {e.blocks[1]}) for e in plan.edges} | {
        s.name: (problem.server_flops, cuts)
        for s in plan.servers
        if s.blocks[1] == plan.num_blocks and s.blocks[0] <= min(cuts)
    }
    for device, (work, trained) in works.items():
        if (reported := timed.get(device)) is None:
            continue
        short = reported.seconds < MIN_STEP_SECONDS * reported.steps
        try:
            if foreign := sorted(set(reported.examples) - trained):
                raise ValueError(f"compute-cuts: cut(s) {foreign} not planned for it")
            rate = speed(reported, work)
            if not 1.0 <= rate < math.inf:  # as announcements: the plan's times must not overflow
                raise ValueError(f"a measured speed of {rate!r} FLOP/s")
            (floors if short else speeds)[device] = rate
        except ValueError as error:
            bad[device] = str(error)
    return speeds, bad, floors


def drifted(
    believed: Mapping[str, float], measured: Mapping[str, float], drift: float
) -> dict[str, tuple[float, float]]:
    """The devices whose ``measured`` speed is off the ``believed`` one by more than
    ``drift`` (a share): device -> (believed, measured)."""
    return {
        d: (believed[d], m)
        for d, m in measured.items()
        if d in believed and abs(m / believed[d] - 1) > drift
    }


class Replanner:
    """Decides, after each committed round, whether measured speeds call for a new plan."""

    def __init__(self, planner: Planner, store: RunStore, drift: float | None) -> None:
        self.planner, self.store, self.drift = planner, store, drift
        self.believed: dict[str, float] = {}  # device -> the FLOP/s the plan used
        self.uplinks: dict[str, float] = {}  # edge -> the uplink (bytes/s) the plan used
        self.replanned_at: int | None = None  # the round after which the last re-plan came
        self.shrunk_tried: set[tuple[tuple[str, int], ...]] = set()  # budgets planned for

    def after_round(
        self,
        number: int,
        placement: Placement,
        reported: Mapping[str, Mapping[str, Any]],
        online: Mapping[str, Announcement],
    ) -> Placement | None:
        """A new placement when round ``number``'s measured speeds (``reported``: each
        device's reply metrics) call for one, else None."""
        plan = placement.plan
        if self.drift is None:
            return None
        if self.replanned_at is not None and number - self.replanned_at < REPLAN_SPACING:
            return None  # measured again once the spacing has passed
        timed, links, bad = _timings(reported)
        profile = self.planner.profile()
        problem = Problem.build(profile, self.planner.partition())
        measured, unusable, floors = measured_speeds(plan, problem, timed)
        for device, why in (bad | unusable).items():
            self._event(number, "speed-unusable", f"timing not used: {why}", device)
        devices = [e.name for e in plan.edges] + [s.name for s in plan.servers]
        if away := [d for d in devices if d not in online]:  # a plan now would leave it out
            log.info("round %d: %s away: speeds compared again once all are back", number, away)
            return None
        believed = {d: self.believed.get(d, online[d].flops) for d in devices}
        measured |= {d: f for d, f in floors.items() if f > believed[d]}  # proven faster
        uplinks = {e.name: self.uplinks.get(e.name, _uplink(online[e.name])) for e in plan.edges}
        links = {d: rate for d, rate in links.items() if d in uplinks}
        off = drifted(believed, measured, self.drift)
        off_links = drifted(uplinks, links, self.drift)
        if not off and not off_links:
            return None
        self.believed, self.uplinks = believed | measured, uplinks | links
        what = ", ".join(
            [f"{d} measured {_rate(m)} (planned with {_rate(b)})" for d, (b, m) in off.items()]
            + [
                f"{d}'s uplink measured {_bandwidth(m)} (planned with {_bandwidth(b)})"
                for d, (b, m) in off_links.items()
            ]
        )
        edges = [self._announced(online[e.name]) for e in plan.edges]
        servers = [self._announced(online[d]) for d in sorted({s.name for s in plan.servers})]
        return self._decide(number, (plan, problem, profile), (edges, servers), what)

    def _decide(
        self,
        number: int,
        planned: tuple[Plan, Problem, ModelProfile],
        devices: tuple[list[Announcement], list[Announcement]],
        what: str,
    ) -> Placement | None:
        """Plan ``devices`` (at their measured speeds) anew; the new placement when it
        predicts a step :data:`MIN_GAIN` shorter than ``plan``'s, else None."""
        (plan, problem, profile), (edges, servers) = planned, devices
        specs = device_specs(edges, servers, self.planner.per_round())
        splits = [e.blocks[1] for e in plan.edges]
        now = step_seconds(problem, specs[: len(edges)], specs[len(edges) :], splits)
        try:
            candidate = plan_split(profile, specs, self.planner.partition())
        except SplitError as error:
            self._kept(number, plan, f"{what}; no plan with them: {error}")
            return None
        then = candidate.estimated_step_seconds
        verdict = f"{what}; predicted step {now:.3g} s, re-planned {then:.3g} s"
        if then > (1 - MIN_GAIN) * now or candidate.edge_cuts() == plan.edge_cuts():
            self._kept(number, plan, f"{verdict}: plan kept")
            return None
        try:  # a refusal keeps the plan: dropping an edge mid-run is not the speeds' call
            new = self.planner.offer(candidate, servers)
        except (CoordinatorError, SplitError) as error:
            new = {"the GPU servers": (str(error), None)}
        if not isinstance(new, Placement):
            why = "; ".join(f"{d}: {r}" for d, (r, _) in new.items())
            self._kept(number, plan, f"{verdict}: plan kept, refused ({why})")
            return None
        self.replanned_at = number
        self.store.set_plan(
            self.planner.config.run_id, self.planner.record(new.plan) | self.measured()
        )
        self._event(number, "replanned", f"{verdict}: new cuts {new.plan.cuts()}")
        log.info("plan after round %d, from measured speeds:\n%s", number, new.plan)
        return new

    def before_first_round(
        self, placement: Placement, online: Mapping[str, Announcement]
    ) -> Placement | None:
        """A new placement when the speeds the edges measured on the blocks they accepted
        (:attr:`Planner.timed`: edges whose speed was not declared) call for one, else
        None: like a re-plan after a round, but before any local head was trained."""
        timed, self.planner.timed = self.planner.timed, {}
        return self.after_round(0, placement, timed, online) if timed else None

    def before_round(
        self, number: int, placement: Placement, online: Mapping[str, Announcement]
    ) -> Placement | None:
        """A new placement for round ``number`` when a GPU server of ``placement`` is lost
        (:meth:`around_lost`) or an edge no longer fits its blocks (:meth:`around_shrunk`),
        ``online`` being the devices online now; else None."""
        servers = [a for a in online.values() if a.role == "gpu"]
        moved = self.around_lost(number, placement, servers)
        return self.around_shrunk(number, moved or placement, online) or moved

    def around_lost(
        self, number: int, placement: Placement, servers: list[Announcement]
    ) -> Placement | None:
        """When a piece of ``placement``'s back has no server among ``servers`` (those online;
        a chain lost one): the back placed on them, the edges' cuts kept, stored as a new
        plan version; None when nothing is lost or they cannot hold it (the round waits for
        the lost server as before)."""
        held = {b.device for b in servers}
        spans_held = {span(b) for b in placement.servers if b.device in held}
        lost = sorted({b.device for b in placement.servers if span(b) not in spans_held})
        if not lost or not servers:
            return None
        try:
            new = self.planner.move_back(placement, self.believed_of([], servers)[1])
        except (CoordinatorError, SplitError) as error:
            log.info("round %d: %s offline, and the back cannot move: %s", number, lost, error)
            return None
        pieces = ", ".join(f"{b.device} [{b.start}, {b.end})" for b in new.servers)
        detail = f"{', '.join(lost)} offline: the back moved to {pieces}"
        run = self.planner.config.run_id
        self.store.set_plan(run, self.planner.record(new.plan) | self.measured())
        self.store.add_event(run, Event("replanned", detail, None, number))
        log.warning("round %d: %s", number, detail)
        return new

    def around_shrunk(
        self, number: int, placement: Placement, online: Mapping[str, Announcement]
    ) -> Placement | None:
        """When an edge of ``placement`` now announces less memory than its blocks need (it
        came back with a smaller ``--memory``, and would refuse them every round): a plan
        made anew for the planned devices, stored as a new plan version (an edge that fits
        no cut is left out, event ``edge-unfit``). None when every edge fits, a planned
        device is away (planned once all are back), or no plan can be made; a budget tried
        once is not tried again."""
        plan = placement.plan
        shrunk = {
            e.name: (online[e.name].memory, e.estimated_peak_bytes)
            for e in plan.edges
            if e.name in online and online[e.name].memory < e.estimated_peak_bytes
        }
        key = tuple(sorted((d, m) for d, (m, _) in shrunk.items()))
        if not shrunk or key in self.shrunk_tried:
            return None
        what = "; ".join(
            f"{d} announces {format_bytes(m)}, its blocks need {format_bytes(p)}"
            for d, (m, p) in shrunk.items()
        )
        devices = [e.name for e in plan.edges] + sorted({s.name for s in plan.servers})
        if away := [d for d in devices if d not in online]:  # a plan now would leave it out
            log.info("round %d: %s; planned again once %s are back", number, what, away)
            return None
        self.shrunk_tried.add(key)
        edges = [online[e.name] for e in plan.edges]
        servers = [online[d] for d in sorted({s.name for s in plan.servers})]
        try:
            new = self.planner.plan(*self.believed_of(edges, servers))
        except (CoordinatorError, SplitError) as error:
            self._event(number, "replan-failed", f"{what}; no new plan: {error}")
            return None
        run = self.planner.config.run_id
        self.store.set_plan(run, self.planner.record(new.plan) | self.measured())
        self._event(number, "replanned", f"{what}: new cuts {new.plan.cuts()}")
        log.warning("before round %d: %s: new plan:\n%s", number, what, new.plan)
        return new

    def _kept(self, number: int, plan: Plan, detail: str) -> None:
        """The plan stays: the speeds measured with it are stored beside it (the same plan
        version), so a restarted coordinator compares against them, not the declared ones."""
        self._event(number, "speed-measured", detail)
        record = self.planner.record(plan) | self.measured()
        self.store.set_plan(self.planner.config.run_id, record, revise=True)

    def measured(self) -> dict[str, Any]:
        """What is stored beside a plan: the speeds the coordinator believes, measured (a new
        plan was made with them, or the plan was kept under them; none measured yet: {})."""
        if not self.believed and not self.uplinks:
            return {}
        return {
            MEASURED_KEY: {
                "flops": dict(self.believed),
                "uplinks": dict(self.uplinks),
                "round": self.replanned_at,
            }
        }

    def restore(self, plan: Mapping[str, Any] | None) -> None:
        """Take up the speeds stored beside a resumed run's plan (a restarted coordinator
        measures on from them, not from the declared ones); a malformed record is ignored."""
        measured = (plan or {}).get(MEASURED_KEY)
        if not isinstance(measured, Mapping):
            return
        flops, uplinks, number = (measured.get(k) for k in ("flops", "uplinks", "round"))
        if _rates(flops) and _rates(uplinks) and (number is None or _count(number)):
            self.believed, self.uplinks = dict(flops), dict(uplinks)  # type: ignore[arg-type]
            self.replanned_at = number

    def believed_of(
        self, edges: list[Announcement], servers: list[Announcement]
    ) -> tuple[list[Announcement], list[Announcement]]:
        """The announced devices at the speeds the coordinator believes (measured, where a
        restarted run took them up from its stored plan)."""
        return [self._announced(a) for a in edges], [self._announced(a) for a in servers]

    def _announced(self, announcement: Announcement) -> Announcement:
        """``announcement`` at the speed (and uplink) the coordinator now believes."""
        device = announcement.device
        return replace(
            announcement,
            flops=self.believed.get(device, announcement.flops),
            uplink=self.uplinks.get(device, announcement.uplink),
        )

    def _event(self, number: int, kind: str, detail: str, device: str | None = None) -> None:
        log.info("%s: %s", f"round {number}" if number else "before round 1", detail)
        self.store.add_event(self.planner.config.run_id, Event(kind, detail, device, number))


def _timings(
    reported: Mapping[str, Mapping[str, Any]],
) -> tuple[dict[str, Timed], dict[str, float], dict[str, str]]:
    """Each device's timed steps and measured uplink from its reply metrics, and why some
    are malformed."""
    timed, links, bad = {}, {}, {}
    for device, metrics in reported.items():
        try:
            if (work := timed_work(metrics)) is not None:
                timed[device] = work
            if (rate := timed_link(metrics)) is not None:
                links[device] = rate
        except ValueError as error:
            bad[device] = str(error)
    return timed, links, bad


def _rates(value: object) -> bool:
    """A stored mapping of device -> positive finite rate."""
    return isinstance(value, Mapping) and all(
        isinstance(k, str)
        and isinstance(v, int | float)
        and not isinstance(v, bool)
        and 0 < v < math.inf
        for k, v in value.items()
    )


def _uplink(announcement: Announcement) -> float:
    return announcement.uplink or 1e9  # as the planner reads a missing one


def _bandwidth(rate: float) -> str:
    return f"{rate * 8 / 1e6:.3g} Mbit/s"


def _rate(flops: float) -> str:
    return f"{flops / 1e9:.3g} GFLOP/s" if math.isfinite(flops) else str(flops)
