"""Measured speeds: reading a device's timing (which may lie), turning it into FLOP/s, and
when a drift calls for a new plan (the clocks that time the steps: ``test_timing.py``)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from coordinator.partitioner import PartitionConfig, Problem, plan_split
from coordinator.planner import MEASURED_KEY, Placement, _answer, device_specs, stored_plan
from coordinator.speed import (
    MIN_STEP_SECONDS,
    REPLAN_SPACING,
    Replanner,
    Timed,
    drifted,
    measured_speeds,
    speed,
    timed_link,
    timed_work,
)
from split_models.cpu import MIN_SHARE
from split_models.plan import EdgeAssignment, Plan, ServerAssignment
from split_models.profiler import ModelProfile, profile_model
from split_models.zoo import build_model
from storage.base import RunStore
from storage.memory import InMemoryRunStore
from wire.roles import Announcement

pytestmark = pytest.mark.unit

GOOD = {
    "compute-seconds": 2.0,
    "compute-steps": 4,
    "compute-cuts": [2],
    "compute-examples": [64],
}


def test_a_quota_lowers_the_speed_of_steps_run_at_full_speed_but_never_raises_one() -> None:
    work = np.array([0.0, 10.0, 100.0])
    flops = 3 * 100 * 64  # three passes over 64 examples at cut 2
    # waited on its link between steps: full speed on the wall clock, a quarter sustained
    burst = Timed(2.0, {2: 64}, 4, cpu_seconds=2.0, share=0.25)
    assert speed(burst, work) == pytest.approx(flops / 2.0 * 0.25)
    # kept busy: the wall clock already shows the quota, the CPU seconds agree
    busy = Timed(8.0, {2: 64}, 4, cpu_seconds=2.0, share=0.25)
    assert speed(busy, work) == pytest.approx(flops / 8.0)
    # a device cannot claim more than its wall clock shows, whatever it reports
    boast = Timed(8.0, {2: 64}, 4, cpu_seconds=1e-6, share=1.0)
    assert speed(boast, work) == pytest.approx(flops / 8.0)
    assert speed(Timed(2.0, {2: 64}, 4), work) == pytest.approx(flops / 2.0)


def test_a_reported_cpu_timing_is_read() -> None:
    timed = timed_work({**GOOD, "compute-cpu-seconds": 1.5, "cpu-share": 0.5})
    assert timed == Timed(2.0, {2: 64}, 4, 1.5, 0.5)


def test_a_reported_timing_is_read() -> None:
    assert timed_work(GOOD) == Timed(2.0, {2: 64}, 4)
    assert timed_work({"num-examples": 3}) is None


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"compute-seconds": True}, "compute-seconds"),
        ({"compute-seconds": -1.0}, "compute-seconds"),
        ({"compute-seconds": math.nan}, "compute-seconds"),
        ({"compute-seconds": math.inf}, "compute-seconds"),
        ({"compute-seconds": 1e-12}, "compute-seconds"),
        ({"compute-cuts": [2, 3]}, "one length"),
        ({"compute-cuts": 2}, "one length"),
        ({"compute-cuts": [], "compute-examples": []}, "0 cuts"),
        ({"compute-cuts": [2, 2], "compute-examples": [1, 1]}, "distinct"),
        ({"compute-examples": [-5]}, "counts"),
        ({"compute-examples": [1.5]}, "counts"),
        ({"compute-cuts": list(range(2000)), "compute-examples": [1] * 2000}, "2000 cuts"),
        ({"compute-steps": 0}, "compute-steps"),
        ({"compute-steps": 65}, "compute-steps"),
        ({"compute-steps": None}, "compute-steps"),
        ({"compute-cpu-seconds": -1.0}, "compute-cpu-seconds"),
        ({"compute-cpu-seconds": math.nan}, "compute-cpu-seconds"),
        ({"compute-cpu-seconds": "1"}, "compute-cpu-seconds"),
        ({"cpu-share": 0.0}, "cpu-share"),
        ({"cpu-share": 1e-300}, "cpu-share"),
        ({"cpu-share": 5e-324}, "cpu-share"),
        ({"cpu-share": 1.5}, "cpu-share"),
        ({"cpu-share": math.nan}, "cpu-share"),
        ({"cpu-share": True}, "cpu-share"),
    ],
)
def test_a_malformed_timing_is_refused_with_what_is_wrong(
    change: dict[str, object], named: str
) -> None:
    with pytest.raises(ValueError, match=named):
        timed_work({**GOOD, **change})


def test_speed_is_the_rate_the_cost_model_would_need_for_the_measured_time() -> None:
    work = np.array([0.0, 10.0, 100.0, 1000.0])
    # three passes (forward and backward) over 64 examples at cut 2 and 8 at cut 3, in 2 s
    assert speed(Timed(2.0, {2: 64, 3: 8}), work) == pytest.approx(3 * (6400 + 8000) / 2.0)
    with pytest.raises(ValueError, match="cut 4"):
        speed(Timed(2.0, {4: 1}), work)
    with pytest.raises(ValueError, match="cut 0"):
        speed(Timed(2.0, {0: 1}), work)
    with pytest.raises(ValueError, match="no example"):
        speed(Timed(2.0, {2: 0}), work)


def _plan(edge_cuts: dict[str, int], servers: dict[str, tuple[int, int]]) -> Plan:
    return Plan(
        model="m",
        num_blocks=4,
        batch_size=8,
        optimizer="sgd",
        local_loss="linear",
        compression="fp32",
        edges=tuple(EdgeAssignment(n, (0, c), 1, 1, 1, 1, 0.1) for n, c in edge_cuts.items()),
        servers=tuple(ServerAssignment(n, b, 1, 1) for n, b in servers.items()),
        estimated_step_seconds=0.1,
        bottleneck="",
    )


def _problem() -> Problem:
    return Problem(
        num_blocks=4,
        memory=[],
        edge_memory=[],
        edge_flops=np.array([0.0, 1e6, 2e6, 3e6, 4e6]),
        server_flops=np.array([4e6, 3e6, 2e6, 1e6, 0.0]),
        cut_bytes=np.zeros(5),
        batch_size=8,
        min_edge_blocks=1,
    )


def test_whole_back_servers_are_measured_chained_pieces_not_short_steps_a_floor() -> None:
    plan = _plan({"pi-01": 1, "pi-02": 2}, {"gpu-a": (1, 4), "gpu-b": (1, 3), "gpu-c": (3, 4)})
    timed = {
        "pi-01": Timed(1.0, {1: 30}, 3),
        "pi-02": Timed(MIN_STEP_SECONDS, {2: 30}, 3),  # 3 ms a step: overhead, not FLOPs
        "gpu-a": Timed(2.0, {1: 30, 2: 30}, 6),
        "gpu-b": Timed(2.0, {1: 30}, 6),  # a chained piece: its work is not the profile's
        "gpu-c": Timed(2.0, {3: 30}, 6),
    }

    speeds, bad, floors = measured_speeds(plan, _problem(), timed)

    assert speeds == {
        "pi-01": pytest.approx(3 * 30 * 1e6 / 1.0),
        "gpu-a": pytest.approx(3 * (30 * 3e6 + 30 * 2e6) / 2.0),
    }
    assert floors == {"pi-02": pytest.approx(3 * 30 * 2e6 / MIN_STEP_SECONDS)}
    assert bad == {}


def test_a_timing_at_a_cut_the_device_does_not_train_is_unusable() -> None:
    plan = _plan({"pi-01": 1, "pi-02": 2}, {"gpu-a": (1, 4)})
    timed = {
        "pi-01": Timed(1.0, {2: 30}, 3),  # a cut of the model, but pi-02's
        "pi-02": Timed(1.0, {2: 30}, 3),
        "gpu-a": Timed(1.0, {1: 30, 3: 30}, 3),  # no edge streams from block 3
    }

    speeds, bad, _ = measured_speeds(plan, _problem(), timed)

    assert set(speeds) == {"pi-02"}
    assert "[2] not planned" in bad["pi-01"] and "[3] not planned" in bad["gpu-a"]


def test_a_speed_under_one_flop_a_second_is_unusable_not_planned_with() -> None:
    plan = _plan({"pi-01": 1, "pi-02": 2}, {"gpu-a": (1, 4)})
    crawl = Timed(600_000.0, {1: 1}, 1, cpu_seconds=600_000.0, share=MIN_SHARE)
    speeds, bad, _ = measured_speeds(plan, _problem(), {"pi-01": crawl})
    assert speeds == {} and "FLOP/s" in bad["pi-01"]


def test_a_drift_beyond_the_share_either_way_is_named() -> None:
    believed = {"a": 100.0, "b": 100.0, "c": 100.0, "d": 100.0}
    measured = {"a": 124.0, "b": 126.0, "c": 74.0, "e": 1.0}
    assert drifted(believed, measured, 0.25) == {"b": (100.0, 126.0), "c": (100.0, 74.0)}


class FakePlanner:
    """The planner's pure side (profile, partition, partitioner) without asking devices."""

    def __init__(self, profile: ModelProfile) -> None:
        self.config = SimpleNamespace(run_id="r1")
        self._profile, self.offered = profile, list[Plan]()
        self.refusals: dict[str, tuple[str, int | None]] = {}  # what the edges answer

    def profile(self) -> ModelProfile:
        return self._profile

    def partition(self) -> PartitionConfig:
        return PartitionConfig(batch_size=16, optimizer="adam")

    def per_round(self) -> tuple[int, int, float]:
        return 16, 1, 0.0

    def record(self, plan: Plan) -> dict[str, object]:
        return plan.to_dict() | {"cuts": "per-device"}

    def plan(self, edges: list[Announcement], servers: list[Announcement]) -> Placement:
        plan = plan_split(self._profile, device_specs(edges, servers), self.partition())
        return Placement(plan, [], [])

    def offer(
        self, plan: Plan, servers: list[Announcement]
    ) -> Placement | dict[str, tuple[str, int | None]]:
        self.offered.append(plan)
        return self.refusals or Placement(plan, [], [])


@pytest.fixture(scope="module")
def cnn() -> ModelProfile:
    return profile_model(build_model("cnn", (1, 8, 8), 10, seed=0), ("linear",), 16)


def _devices(edge_flops: float) -> dict[str, Announcement]:
    return {
        "pi-01": Announcement("pi-01", "edge", 1 << 30, edge_flops, 1e9),
        "gpu-a": Announcement("gpu-a", "gpu", 1 << 30, 1e12),
    }


def _setup(cnn: ModelProfile, drift: float | None) -> tuple[Replanner, FakePlanner, RunStore]:
    store = InMemoryRunStore()
    store.create_run("r1", {}, 0)
    store.set_plan("r1", {"first": True})  # as the coordinator stores its first plan
    planner = FakePlanner(cnn)
    return Replanner(planner, store, drift), planner, store  # type: ignore[arg-type]


def _timing(device_cut: int, seconds: float) -> dict[str, object]:
    return {
        "compute-seconds": seconds,
        "compute-steps": 1,
        "compute-cuts": [device_cut],
        "compute-examples": [6400],
    }


def _placement(planner: FakePlanner, online: dict[str, Announcement]) -> Placement:
    return planner.plan([online["pi-01"]], [online["gpu-a"]])


def _planned(
    cnn: ModelProfile, online: dict[str, Announcement]
) -> tuple[Replanner, FakePlanner, RunStore, dict[str, Announcement], Placement, int]:
    """A replanner at drift 0.25 over ``online``'s first plan, and pi-01's cut in it."""
    replanner, planner, store = _setup(cnn, 0.25)
    placement = _placement(planner, online)
    return replanner, planner, store, online, placement, placement.plan.edges[0].blocks[1]


def test_an_edge_far_slower_than_declared_gets_a_new_plan(cnn: ModelProfile) -> None:
    replanner, planner, store, online, placement, cut = _planned(cnn, _devices(1e12))

    new = replanner.after_round(1, placement, {"pi-01": _timing(cut, 2.0)}, online)

    assert new is not None and new.plan.edges[0].blocks[1] < cut
    assert replanner.believed["pi-01"] < 1e11  # planned at the measured speed
    assert planner.offered == [new.plan]
    assert store.get_run("r1").plan_version == 2
    assert [e.kind for e in store.events("r1")] == ["replanned"]


def test_a_speed_within_the_drift_or_a_small_gain_keeps_the_plan(cnn: ModelProfile) -> None:
    replanner, planner, store, online, placement, cut = _planned(cnn, _devices(1e10))
    work = 3 * 6400 * Problem.build(cnn, planner.partition()).edge_flops[cut]

    # measured at 0.9x the declared speed: within the drift
    assert (
        replanner.after_round(1, placement, {"pi-01": _timing(cut, work / 0.9e10)}, online) is None
    )
    # measured at half of it: off, but the same cut is still the best (the server is fast)
    assert (
        replanner.after_round(2, placement, {"pi-01": _timing(cut, work / 0.5e10)}, online) is None
    )

    assert planner.offered == [] and store.get_run("r1").plan_version == 1
    assert [(e.kind, e.round) for e in store.events("r1")] == [("speed-measured", 2)]
    assert "plan kept" in store.events("r1")[0].detail


def test_a_malformed_timing_is_an_event_and_changes_nothing(cnn: ModelProfile) -> None:
    replanner, planner, store = _setup(cnn, 0.25)
    online = _devices(1e12)
    placement = _placement(planner, online)

    lying = {**_timing(1, 2.0), "compute-cuts": [999]}  # not a cut of the model
    assert replanner.after_round(1, placement, {"pi-01": lying}, online) is None

    (event,) = store.events("r1")
    assert (event.kind, event.device) == ("speed-unusable", "pi-01")
    assert "[999] not planned" in event.detail


def test_no_replan_while_a_device_is_away_or_when_turned_off(cnn: ModelProfile) -> None:
    for drift, online in [(0.25, {"gpu-a": _devices(1e12)["gpu-a"]}), (None, _devices(1e12))]:
        replanner, planner, store = _setup(cnn, drift)
        placement = _placement(planner, _devices(1e12))
        cut = placement.plan.edges[0].blocks[1]
        assert replanner.after_round(1, placement, {"pi-01": _timing(cut, 2.0)}, online) is None
        assert store.events("r1") == []


def test_a_reported_uplink_is_read_and_a_malformed_one_refused() -> None:
    assert timed_link({"uplink-seconds": 0.5, "uplink-bytes": 1000}) == 2000.0
    assert timed_link({"uplink-seconds": 0.01, "uplink-bytes": 1000}) is None  # too little
    assert timed_link({}) is None
    bad = [(math.nan, 10), (-1.0, 10), (0.5, -3), (0.5, 0), (True, 10), (600_000.0, 1)]
    for seconds, size in bad:
        with pytest.raises(ValueError, match="uplink"):
            timed_link({"uplink-seconds": seconds, "uplink-bytes": size})


def test_an_uplink_far_slower_than_declared_is_planned_with(cnn: ModelProfile) -> None:
    replanner, planner, store, online, placement, cut = _planned(cnn, _devices(1e12))
    work = 3 * 6400 * Problem.build(cnn, planner.partition()).edge_flops[cut]
    reported = {**_timing(cut, work / 1e12 + 0.02), "uplink-seconds": 2.0, "uplink-bytes": 20_000}

    replanner.after_round(1, placement, {"pi-01": reported}, online)

    (event,) = store.events("r1")
    assert "pi-01's uplink measured 0.08 Mbit/s (planned with 8e+03 Mbit/s)" in event.detail
    # the cut whose activations are smallest: the upload bounds the step now
    assert event.kind == "replanned" and "new cuts {'pi-01': 5}" in event.detail
    assert replanner.uplinks["pi-01"] == pytest.approx(10_000)


def test_re_plans_from_speeds_are_spaced_apart(cnn: ModelProfile) -> None:
    replanner, _planner, store, online, placement, cut = _planned(cnn, _devices(1e12))
    first = replanner.after_round(1, placement, {"pi-01": _timing(cut, 2.0)}, online)
    assert first is not None
    new_cut = first.plan.edges[0].blocks[1]

    # the device now reports a hundred times faster: not heard until the spacing passed
    fast = {"pi-01": _timing(new_cut, 2e-2)}
    later = [replanner.after_round(n, first, fast, online) for n in range(2, 2 + REPLAN_SPACING)]

    assert later[:-1] == [None] * (REPLAN_SPACING - 1)
    assert [e.round for e in store.events("r1")][-1] == 1 + REPLAN_SPACING


def test_short_steps_raise_a_speed_declared_too_low_but_never_lower_one(
    cnn: ModelProfile,
) -> None:
    replanner, _planner, store, online, placement, cut = _planned(
        cnn, {**_devices(1e12), "pi-01": Announcement("pi-01", "edge", 1 << 30, 1e3, 1e9)}
    )
    short = {**_timing(cut, 0.005), "compute-steps": 4}  # 1.25 ms a step: overhead mostly

    replanner.after_round(1, placement, {"pi-01": short}, online)

    # the rate of short steps is a floor: above the 1 kFLOP/s declared, so it is believed
    assert replanner.believed["pi-01"] > 1e6
    assert "pi-01 measured" in store.events("r1")[0].detail

    replanner, _planner, store, online, placement, cut = _planned(cnn, _devices(1e15))
    # declared faster than the floor: the floor says nothing
    replanner.after_round(
        1, placement, {"pi-01": {**_timing(cut, 0.005), "compute-steps": 4}}, online
    )
    assert store.events("r1") == [] and replanner.believed == {}


def test_an_edge_that_refuses_the_new_plan_keeps_the_old_one(cnn: ModelProfile) -> None:
    replanner, planner, store, online, placement, cut = _planned(cnn, _devices(1e12))
    planner.refusals = {"pi-01": ("sent a malformed answer to the assignment", None)}

    assert replanner.after_round(1, placement, {"pi-01": _timing(cut, 2.0)}, online) is None

    (event,) = store.events("r1")
    assert event.kind == "speed-measured" and "plan kept, refused" in event.detail
    assert len(planner.offered) == 1 and store.get_run("r1").plan_version == 1


def _answered(metrics: dict[str, object] | None, answer: dict[str, object] | None) -> Message:
    content = RecordDict()
    if metrics is not None:
        content["metrics"] = MetricRecord(metrics)  # type: ignore[arg-type]
    if answer is not None:
        content["answer"] = ConfigRecord(answer)  # type: ignore[arg-type]
    # a message needs the run it belongs to (the coordinator's grid sets it): set here, and
    # put back after, since it is process-wide
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    try:
        template = Message(RecordDict(), dst_node_id=1, message_type="query")
        return Message(content, reply_to=template)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def test_a_malformed_answer_to_an_assignment_is_a_refusal_not_a_crash() -> None:
    assert _answer(_answered({"accepted": 1, "budget": 100}, {"reason": ""})) == (True, 100, "")
    assert _answer(_answered({"accepted": 0, "budget": 9}, {"reason": "no"})) == (False, 9, "no")
    for metrics, answer in [
        ({"accepted": 0.5, "budget": 100}, {"reason": ""}),
        ({"accepted": 0, "budget": 100}, None),
        (None, {"reason": "x"}),
        ({"budget": 100}, {"reason": "x"}),
        ({"accepted": 1, "budget": [1]}, {"reason": "x"}),
    ]:
        assert _answer(_answered(metrics, answer)) is None


def test_a_restarted_coordinator_takes_up_the_measured_speeds_of_the_stored_plan(
    cnn: ModelProfile,
) -> None:
    replanner, planner, store, online, placement, cut = _planned(cnn, _devices(1e12))
    assert replanner.after_round(1, placement, {"pi-01": _timing(cut, 2.0)}, online) is not None
    run = store.get_run("r1")

    again = Replanner(planner, store, 0.25)  # type: ignore[arg-type]
    again.restore(run.plan)

    assert (again.believed, again.uplinks) == (replanner.believed, replanner.uplinks)
    assert again.replanned_at == 1 and again.believed["pi-01"] < 1e11
    stored = stored_plan(run)  # the plan itself still loads, the speeds beside it
    assert stored is not None and stored.edges[0].blocks[1] < cut
    for bad in ({"flops": {"pi-01": -1.0}, "uplinks": {}}, {"flops": "x"}, "x", None):
        ignored = Replanner(planner, store, 0.25)  # type: ignore[arg-type]
        ignored.restore({**(run.plan or {}), MEASURED_KEY: bad})
        assert ignored.believed == {} and ignored.replanned_at is None


def test_speeds_measured_under_a_kept_plan_are_stored_beside_it_for_a_restart(
    cnn: ModelProfile,
) -> None:
    replanner, planner, store, online, placement, cut = _planned(cnn, _devices(1e10))
    work = 3 * 6400 * Problem.build(cnn, planner.partition()).edge_flops[cut]
    assert (
        replanner.after_round(1, placement, {"pi-01": _timing(cut, work / 0.5e10)}, online) is None
    )
    run = store.get_run("r1")
    assert run.plan_version == 1  # the same plan: no new version

    again = Replanner(planner, store, 0.25)  # type: ignore[arg-type]
    again.restore(run.plan)

    assert again.believed == replanner.believed
    assert again.believed["pi-01"] == pytest.approx(0.5e10, rel=0.05)
    assert again.replanned_at is None  # measured, never re-planned: no spacing to keep
    stored = stored_plan(run)
    assert stored is not None and stored.edge_cuts() == placement.plan.edge_cuts()


def test_an_edges_batches_a_round_leave_out_its_federated_evaluation_share() -> None:
    edge = Announcement("pi", "edge", 2**26, 1e9, 1e6, examples=100)
    (all_of_it,) = device_specs([edge], [], (10, 2, 0.0))
    (held_out,) = device_specs([edge], [], (10, 2, 0.25))
    assert (all_of_it.round_batches, held_out.round_batches) == (20, 16)  # 100, then 75 trained
