"""Re-planning from measured speeds in a real run (in-process transport, SQLite store): edges
that declared themselves far faster than they train get shallower cuts after round 1, the
new plan is stored as a new version, and training goes on at the new cuts."""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.config import RunConfig
from coordinator.partitioner import plan_split
from coordinator.planner import MEASURED_KEY, Placement, Planner, device_specs
from coordinator.service import Coordinator
from edge_client.agent import EdgeAgent
from gpu_server.agent import GpuAgent
from split_models import load_dataset
from split_models.profiler import ModelProfile
from split_models.segment import Segment, StepResult
from storage.base import RunStore
from wire.flower import node_will
from wire.roles import Announcement, node_id_for
from wire.topics import announcement as announcement_topic
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration

EDGES = ("pi-01", "pi-02")
SHAPE = (1, 8, 8)
SLOW_STEP_SECONDS = 0.05  # what each edge step takes beyond its compute (a slow device)


@pytest.fixture
def slow_edges(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every edge step takes SLOW_STEP_SECONDS longer (GPU servers train through
    ``Segment.train_from``, untouched)."""
    step = Segment.train_step

    def slow(self: Segment, inputs: object, labels: object) -> StepResult:
        time.sleep(SLOW_STEP_SECONDS)
        return step(self, inputs, labels)  # type: ignore[arg-type]

    monkeypatch.setattr(Segment, "train_step", slow)


def run_config(
    tmp_path: Path, drift: float | None, strategy: dict[str, object] | None = None
) -> RunConfig:
    data = load_dataset("digits")
    rows = np.random.default_rng(0).permutation(len(data))
    for index, name in enumerate(EDGES):
        part = rows[index * 160 : (index + 1) * 160]
        np.savez(tmp_path / f"{name}.npz", x=data.x[part], y=data.y[part])
    np.savez(tmp_path / "test.npz", x=data.x[rows[-300:]], y=data.y[rows[-300:]])
    return RunConfig.parse(
        {
            "run_id": "speed-1",
            "model": "cnn",
            "input_shape": list(SHAPE),
            "num_classes": 10,
            "eval_data": f"npz:{tmp_path / 'test.npz'}",
            "devices": {"edges": list(EDGES), "wait": "30s", "replan_drift": drift},
            "rounds": 3,
            "batch_size": 16,
            "optimizer": {"name": "adam", "lr": 0.002},
            "round_deadline": "60s",
            "strategy": strategy or {"name": "fedavg"},
            # the GPU server trains the edges' batches in name order, so the losses do not
            # depend on timing (FedAvgM at momentum 0.9 came near the loss-jump guard at
            # round 3 for some arrival orders under CI load)
            "deterministic": True,
        }
    )


def start_fleet(
    hub: InProcessHub, tmp_path: Path, time_tasks: bool = False
) -> tuple[list[EdgeAgent], GpuAgent]:
    """Two edges and a GPU server that all declare 1 TFLOP/s (the edges are far slower);
    ``time_tasks``: the edges time the blocks they accept (``edgesplit edge --flops auto``)."""
    server = GpuAgent(
        Announcement("gpu-a", "gpu", 1 << 30, 1e12),
        hub.connect("gpu-a-control", node_will(node_id_for("gpu-a"), "gpu-a")),
        hub.connect("gpu-a-stream"),
    )
    edges = [
        EdgeAgent(
            Announcement(name, "edge", 1 << 30, 1e12, 1e9),
            load_dataset(f"npz:{tmp_path / f'{name}.npz'}"),
            hub.connect(f"{name}-control", node_will(node_id_for(name), name)),
            hub.connect(f"{name}-stream"),
            time_tasks=time_tasks,
        )
        for name in EDGES
    ]
    return edges, server


def cuts(store: RunStore) -> dict[str, int]:
    plan = store.get_run("speed-1").plan or {}
    return {edge["name"]: edge["blocks"][1] for edge in plan["edges"]}


# server-side optimizers keep state per tensor: the new cuts' heads join it mid-run
@pytest.mark.parametrize(
    "strategy",
    [{"name": "fedavg"}, {"name": "fedadam"}, {"name": "fedavgm", "server_momentum": 0.9}],
    ids=["fedavg", "fedadam", "fedavgm"],
)
def test_edges_slower_than_declared_are_replanned_to_shallower_cuts(
    tmp_path: Path,
    store: RunStore,
    profile: ModelProfile,
    slow_edges: None,
    strategy: dict[str, object],
) -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = run_config(tmp_path, 0.25, strategy)  # writes the edges' data
    hub = InProcessHub()
    edges, _ = start_fleet(hub, tmp_path)
    planned: list[dict[str, int]] = []
    original = store.set_plan

    def record(run_id: str, plan: Mapping[str, Any], revise: bool = False) -> int:
        version = original(run_id, plan, revise=revise)
        if not revise:  # a new plan, not speeds noted beside the one in use
            planned.append(cuts(store))
        return version

    store.set_plan = record  # type: ignore[method-assign]
    coordinator = Coordinator(config, store, hub.connect("coordinator"), profile=lambda _: profile)

    assert coordinator.run() == 3

    run = store.get_run("speed-1")
    assert (run.status, run.plan_version) == ("finished", 2)
    first, second = planned
    assert all(second[name] < first[name] for name in EDGES), planned
    events = store.events("speed-1")
    assert [e.detail for e in events if e.kind == "planned"] == [f"cuts {first}"]
    replanned = [e for e in events if e.kind == "replanned"]
    assert [e.round for e in replanned] == [1]
    assert replanned[0].detail.endswith(f"new cuts {second}")
    assert all(f"{name} measured" in replanned[0].detail for name in EDGES)
    # the edges trained the last rounds at their new cuts
    assert {e.device: e._built.trainer.segment.end for e in edges} == second  # type: ignore[union-attr]
    assert store.get_round("speed-1", 3).evaluation["accuracy"] > 0.15


def test_edges_that_time_the_blocks_they_accept_are_replanned_before_round_1(
    tmp_path: Path, store: RunStore, profile: ModelProfile, slow_edges: None
) -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = run_config(tmp_path, 0.25)
    config = RunConfig.parse({**config.to_dict(), "rounds": 1})  # no re-plan after a round
    hub = InProcessHub()
    edges, _ = start_fleet(hub, tmp_path, time_tasks=True)
    coordinator = Coordinator(config, store, hub.connect("coordinator"), profile=lambda _: profile)

    assert coordinator.run() == 1

    run = store.get_run("speed-1")
    assert run.plan_version == 2
    events = store.events("speed-1")
    first = next(e.detail for e in events if e.kind == "planned")
    replanned = [e for e in events if e.kind == "replanned"]
    assert [e.round for e in replanned] == [0], [(e.kind, e.detail) for e in events]
    assert all(f"{name} measured" in replanned[0].detail for name in EDGES)
    second = cuts(store)
    assert first != f"cuts {second}"
    assert all(second[n] < int(first.split(f"'{n}': ")[1][0]) for n in EDGES), (first, second)
    # round 1 trained at the cuts the timings called for
    assert {e.device: e._built.trainer.segment.end for e in edges} == second  # type: ignore[union-attr]
    assert (run.plan or {})[MEASURED_KEY]["round"] == 0


def test_without_a_drift_the_plan_stays(
    tmp_path: Path, store: RunStore, profile: ModelProfile, slow_edges: None
) -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = run_config(tmp_path, None)
    hub = InProcessHub()
    start_fleet(hub, tmp_path)
    coordinator = Coordinator(config, store, hub.connect("coordinator"), profile=lambda _: profile)

    assert coordinator.run() == 3

    assert store.get_run("speed-1").plan_version == 1
    assert not [e for e in store.events("speed-1") if e.kind in {"replanned", "speed-measured"}]


def test_a_resume_that_plans_anew_plans_at_the_speeds_measured_before_it(
    tmp_path: Path, store: RunStore, profile: ModelProfile, slow_edges: None
) -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = run_config(tmp_path, 0.25)
    hub = InProcessHub()
    start_fleet(hub, tmp_path)
    assert Coordinator(config, store, hub.connect("c1"), profile=lambda _: profile).run() == 3
    first = next(e.detail for e in store.events("speed-1") if e.kind == "planned")
    measured = cuts(store)
    assert store.get_run("speed-1").plan_version == 2 and first != f"cuts {measured}"

    # restarted for a fourth round with one cut for all: the stored plan no longer fits the
    # config, so it plans anew, at the edges' measured speeds (not the declared ones)
    data = {**config.to_dict(), "rounds": 4}
    data["devices"] = {**data["devices"], "cuts": "uniform"}
    again = Coordinator(RunConfig.parse(data), store, hub.connect("c2"), profile=lambda _: profile)
    assert again.run() == 1

    run = store.get_run("speed-1")
    assert run.plan_version == 3 and len(set(cuts(store).values())) == 1
    speeds = (run.plan or {}).get(MEASURED_KEY)
    assert speeds, "the speeds stay beside the new plan"
    # the uniform cut is the partitioner's at the measured speeds, not at the declared ones
    planner = again.planner
    assert cuts(store) == uniform_cuts(planner, profile, speeds["flops"], speeds["uplinks"])
    assert cuts(store) != uniform_cuts(planner, profile, {}, {}), "declared speeds plan alike"


def uniform_cuts(
    planner: Planner,
    profile: ModelProfile,
    flops: Mapping[str, float],
    uplinks: Mapping[str, float],
) -> dict[str, int]:
    """The edges' cuts the partitioner gives the test's fleet (160 examples per edge, speeds
    as declared unless ``flops`` or ``uplinks`` name them)."""
    edges = [
        Announcement(e, "edge", 1 << 30, flops.get(e, 1e12), uplinks.get(e, 1e9), examples=160)
        for e in EDGES
    ]
    servers = [Announcement("gpu-a", "gpu", 1 << 30, flops.get("gpu-a", 1e12))]
    specs = device_specs(edges, servers, planner.per_round())
    plan = plan_split(profile, specs, planner.partition())
    return {edge.name: edge.blocks[1] for edge in plan.edges}


def come_back_smaller(coordinator: Coordinator, edge: EdgeAgent, memory: int) -> None:
    """``edge`` says it has ``memory`` now, as an agent restarted with a smaller ``--memory``
    does (its retained announcement), and refuses blocks above it; returns once the
    coordinator has heard it."""
    edge.budget = memory
    edge.announcement = dataclasses.replace(edge.announcement, memory=memory)
    topic = announcement_topic(edge.device, "edge")
    edge.channel.transport.publish(topic, edge.announcement.to_json(), retain=True)
    deadline = time.monotonic() + 10
    while coordinator.online()[edge.device].memory != memory:
        assert time.monotonic() < deadline, "the coordinator never heard the new announcement"
        time.sleep(0.01)


def step_bounds_sent(monkeypatch: pytest.MonkeyPatch) -> dict[tuple[str, int], object]:
    """The bound on each step (``max-step``) each train message the coordinator builds from
    now on carries, by device and round (None: none)."""
    from coordinator import service

    told: dict[tuple[str, int], object] = {}
    build = service.build_message

    def record(grid: Any, node: int, arrays: Any, kind: str, number: int = 0, *rest: Any) -> Any:
        message = build(grid, node, arrays, kind, number, *rest)
        if kind == "train":
            device = next(d for d in (*EDGES, "gpu-a") if node_id_for(d) == node)
            told[(device, number)] = message.content.config_records["config"].get("max-step")
        return message

    monkeypatch.setattr(service, "build_message", record)
    return told


def test_an_edge_that_comes_back_with_less_memory_is_planned_anew(
    tmp_path: Path, store: RunStore, profile: ModelProfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    config = run_config(tmp_path, None)  # no re-plans from speeds: only the memory moves cuts
    hub = InProcessHub()
    edges, _ = start_fleet(hub, tmp_path)
    coordinator = Coordinator(config, store, hub.connect("coordinator"), profile=lambda _: profile)
    first: dict[str, int] = {}
    planned_peak: list[int] = []
    before_round = coordinator.replanner.before_round

    def shrink_before_round_2(number: int, placement: Placement, online: Any) -> Any:
        if number == 2 and not first:  # round 1 trained at the first plan's cuts
            first.update(cuts(store))
            edge = next(e for e in placement.plan.edges if e.name == EDGES[0])
            planned_peak.append(edge.estimated_peak_bytes)
            come_back_smaller(coordinator, edges[0], edge.estimated_peak_bytes - 1)
            online = coordinator.online()
        return before_round(number, placement, online)

    coordinator.replanner.before_round = shrink_before_round_2  # type: ignore[method-assign]
    told = step_bounds_sent(monkeypatch)

    assert coordinator.run() == 3

    run = store.get_run("speed-1")
    assert run.status == "finished" and run.plan_version == 2
    second = cuts(store)
    assert second[EDGES[0]] < first[EDGES[0]], (first, second)
    new_edge = next(e for e in (run.plan or {})["edges"] if e["name"] == EDGES[0])
    assert new_edge["estimated_peak_bytes"] < planned_peak[0]
    replanned = [e for e in store.events("speed-1") if e.kind == "replanned"]
    assert [e.round for e in replanned] == [2]
    assert f"{EDGES[0]} announces" in replanned[0].detail
    assert replanned[0].detail.endswith(f"new cuts {second}")
    # the edge trained rounds 2 and 3 at its new cut instead of refusing its old blocks
    for number in (2, 3):
        results = {r.device: r for r in store.get_round("speed-1", number).results}
        assert results[EDGES[0]].failure is None and results[EDGES[0]].examples > 0
    assert edges[0]._built.trainer.segment.end == second[EDGES[0]]  # type: ignore[union-attr]
    # its first round at the new cut stepped within the GPU servers' bound; no other did
    bounded = {key for key, bound in told.items() if bound is not None}
    assert bounded == {(EDGES[0], 2)} and told[(EDGES[0], 2)] == config.training.server_max_step
    assert edges[0]._built.trainer.segment.step_bound is None  # type: ignore[union-attr]
