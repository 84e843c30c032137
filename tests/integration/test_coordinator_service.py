"""The coordinator service with real agents on the in-process transport and a SQLite store:
assignment refusals and re-planning, backprop mode, and clear failures."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import numpy as np
import pytest
from flwr.app import Message

from coordinator.config import RunConfig
from coordinator.partitioner import PartitionConfig, Problem
from coordinator.service import Coordinator, CoordinatorError
from edge_client.agent import EdgeAgent
from gpu_server.agent import GpuAgent
from split_models import load_dataset
from split_models.data import Dataset
from split_models.errors import ConfigError
from split_models.profiler import ModelProfile
from storage.base import RunStore
from wire import topics
from wire.broker import Broker
from wire.flower import _Frames, node_will
from wire.mqtt import MqttConfig, MqttTransport
from wire.roles import Announcement, node_id_for
from wire.transport import InProcessHub, Transport, Will

pytestmark = pytest.mark.integration

EDGES = ("pi-01", "pi-02")
SHAPE = (1, 8, 8)


def config(tmp_path: Path, **changes: object) -> RunConfig:
    data = load_dataset("digits")
    rows = np.random.default_rng(0).permutation(len(data))
    np.savez(tmp_path / "test.npz", x=data.x[rows[:400]], y=data.y[rows[:400]])
    for index, name in enumerate(EDGES):
        part = rows[400 + index * 600 : 400 + (index + 1) * 600]
        np.savez(tmp_path / f"{name}.npz", x=data.x[part], y=data.y[part])
    fields: dict[str, object] = {
        "run_id": "svc-1",
        "model": "cnn",
        "input_shape": list(SHAPE),
        "num_classes": 10,
        "eval_data": f"npz:{tmp_path / 'test.npz'}",
        "devices": {"edges": list(EDGES), "gpu_servers": 1, "wait": "30s"},
        "rounds": 2,
        "batch_size": 16,
        "optimizer": {"name": "adam", "lr": 0.002},
        "round_deadline": "60s",
    }
    fields.update(changes)
    return RunConfig.parse(fields)


def start_fleet(
    hub: InProcessHub | MqttHub,
    tmp_path: Path,
    memory: dict[str, int],
    budget: dict[str, int],
    servers: tuple[str, ...] = ("gpu-a",),
    server_memory: int = 1 << 30,
) -> list[EdgeAgent]:
    gpus = [
        GpuAgent(
            Announcement(name, "gpu", server_memory, 1e9),
            hub.connect(f"{name}-control", node_will(node_id_for(name), name)),
            hub.connect(f"{name}-stream"),
        )
        for name in servers
    ]
    start_fleet.gpus = gpus  # type: ignore[attr-defined]
    return [
        EdgeAgent(
            Announcement(name, "edge", memory[name], 1e12, 1e7),
            load_dataset(f"npz:{tmp_path / f'{name}.npz'}"),
            hub.connect(f"{name}-control", node_will(node_id_for(name), name)),
            hub.connect(f"{name}-stream"),
            budget=budget.get(name),
        )
        for name in EDGES
    ]


def test_an_edge_that_refuses_is_replanned_within_the_budget_it_reports(
    tmp_path: Path, store: RunStore, profile: ModelProfile
) -> None:
    run = config(tmp_path, rounds=1)
    memory = Problem.build(profile, PartitionConfig(batch_size=16, optimizer="adam")).edge_memory
    deepest = max(range(1, len(memory) - 1), key=lambda s: memory[s])
    shallow = min(range(1, len(memory) - 1), key=lambda s: memory[s])
    # pi-01 announced room for its deepest prefix, but now has only room for the shallowest
    hub = InProcessHub()
    start_fleet(
        hub,
        tmp_path,
        {"pi-01": memory[deepest] + 1024, "pi-02": memory[deepest] + 1024},
        {"pi-01": memory[shallow] + 1024},
    )
    coordinator = Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile)
    assert coordinator.run() == 1
    assert "budget" in coordinator.refusals["pi-01"]
    events = [e for e in store.events("svc-1") if e.kind == "assignment-refused"]
    assert [e.device for e in events] == ["pi-01"]
    plan = store.get_run("svc-1").plan
    assert plan is not None
    blocks = {edge["name"]: edge["blocks"] for edge in plan["edges"]}
    assert memory[blocks["pi-01"][1]] <= memory[shallow] + 1024, blocks
    assert store.get_run("svc-1").status == "finished"


@pytest.mark.parametrize("lie", ["announced", "budget"])
def test_an_edge_that_fits_no_segment_is_left_out_and_the_others_train(
    tmp_path: Path, store: RunStore, profile: ModelProfile, lie: str
) -> None:
    run = config(tmp_path, rounds=1)
    memory = Problem.build(profile, PartitionConfig(batch_size=16, optimizer="adam")).edge_memory
    roomy = max(memory[1:-1]) + 1024
    hub = InProcessHub()
    if lie == "announced":  # a device too small for this model (or announcing 1 byte)
        start_fleet(hub, tmp_path, {"pi-01": 4096, "pi-02": roomy}, {})
    else:  # announces room, then refuses with a budget that holds nothing
        start_fleet(hub, tmp_path, {"pi-01": roomy, "pi-02": roomy}, {"pi-01": 4096})
    coordinator = Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile)

    assert coordinator.run() == 1  # it failed at planning: "pi-01 has 4.0 KiB but ..."
    plan = store.get_run("svc-1").plan
    assert plan is not None and [e["name"] for e in plan["edges"]] == ["pi-02"]
    (left,) = [e for e in store.events("svc-1") if e.kind == "edge-unfit"]
    assert left.device == "pi-01" and "edge 'pi-01' has 4.0 KiB" in left.detail, left.detail
    assert store.get_run("svc-1").status == "finished"


def test_a_finished_run_says_so_and_a_replayed_task_of_it_is_abandoned(
    tmp_path: Path, store: RunStore, profile: ModelProfile
) -> None:
    """A task of a finished run replayed to a freshly started edge was taken up: the
    retained session still named the finished coordinator's session as current."""
    from tests.unit.test_session import _until
    from wire.session import SessionWatch, parse_announcement

    run = config(tmp_path, rounds=1)
    hub = InProcessHub()
    start_fleet(hub, tmp_path, dict.fromkeys(("pi-01", "pi-02"), 1 << 30), {})
    coordinator = Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile)
    assert coordinator.run() == 1
    seen: list[bytes] = []
    hub.connect("watcher").subscribe(topics.coordinator("svc-1"), lambda _t, p: seen.append(p))
    _until(lambda: bool(seen))
    announced = parse_announcement(seen[-1])
    assert announced is not None and announced[0] == coordinator.session
    assert announced[1][0] > run.training.rounds, "the session drives no more rounds"
    edge = SessionWatch(hub.connect("fresh-edge"))  # round 1's task, replayed
    cancelled = edge.follow("svc-1", coordinator.session, (1, 1))
    _until(cancelled)
    assert cancelled(), "the replayed task's round counts as abandoned"


def test_a_resumed_run_keeps_its_stored_plan_while_its_devices_still_fit(
    tmp_path: Path, store: RunStore, profile: ModelProfile
) -> None:
    memory = Problem.build(profile, PartitionConfig(batch_size=16, optimizer="adam")).edge_memory
    deepest = max(range(1, len(memory) - 1), key=lambda s: memory[s])
    shallow = min(range(1, len(memory) - 1), key=lambda s: memory[s])
    profiled: list[str] = []

    def profile_once(_config: RunConfig) -> ModelProfile:
        profiled.append("profile")
        return profile

    runs = [config(tmp_path, rounds=rounds) for rounds in (1, 2, 3)]  # writes the edges' data
    roomy = {name: memory[deepest] + 1024 for name in EDGES}
    hub = InProcessHub()
    start_fleet(hub, tmp_path, roomy, {})
    first = Coordinator(runs[0], store, hub.connect("c1"), profile=profile_once)
    assert first.run() == 1
    planned = store.get_run("svc-1")
    assert planned.plan is not None and planned.plan_version == 1

    # restarted with the same devices: same plan, no new profile, the remaining round trains
    again = Coordinator(runs[1], store, hub.connect("c2"), profile=profile_once)
    assert again.run() == 1
    kept = store.get_run("svc-1")
    assert (kept.plan_version, kept.plan, profiled) == (1, planned.plan, ["profile"])

    # restarted after pi-01 lost memory: its stored blocks no longer fit, so plan anew
    hub = InProcessHub()
    start_fleet(hub, tmp_path, {**roomy, "pi-01": memory[shallow] + 1024}, {})
    third = Coordinator(runs[2], store, hub.connect("c3"), profile=profile_once)
    assert third.run() == 1
    replanned = store.get_run("svc-1")
    assert replanned.plan_version == 2 and len(profiled) == 1  # the stored profile reused
    blocks = {edge["name"]: edge["blocks"] for edge in (replanned.plan or {})["edges"]}
    assert memory[blocks["pi-01"][1]] <= memory[shallow] + 1024, blocks
    assert replanned.status == "finished"


def test_a_resumed_run_plans_anew_when_devices_cuts_changed_either_way(
    tmp_path: Path, store: RunStore, profile: ModelProfile
) -> None:
    memory = Problem.build(profile, PartitionConfig(batch_size=16, optimizer="adam")).edge_memory
    shallow = min(range(1, len(memory) - 1), key=lambda s: memory[s])
    devices = {"edges": list(EDGES), "gpu_servers": 1, "wait": "30s"}
    modes = ["per-device", "uniform", "per-device"]
    runs = [
        config(tmp_path, rounds=n, devices={**devices, "cuts": mode})
        for n, mode in enumerate(modes, 1)
    ]
    hub = InProcessHub()  # pi-01 holds only the shallowest cut, pi-02 any
    start_fleet(hub, tmp_path, {"pi-01": memory[shallow] + 1024, "pi-02": 1 << 30}, {})
    cuts = []
    for number, run in enumerate(runs, 1):
        assert Coordinator(run, store, hub.connect(f"c{number}"), profile=lambda _: profile).run()
        stored = store.get_run("svc-1")
        assert (stored.plan_version, (stored.plan or {})["cuts"]) == (number, modes[number - 1])
        cuts.append({edge["name"]: edge["blocks"][1] for edge in (stored.plan or {})["edges"]})
    assert cuts[0]["pi-01"] < cuts[0]["pi-02"] and cuts[2] == cuts[0]
    assert cuts[1] == {"pi-01": cuts[0]["pi-01"], "pi-02": cuts[0]["pi-01"]}
    planned = [e.detail for e in store.events("svc-1") if e.kind == "planned"]
    assert planned == [f"cuts {c}" for c in cuts]


@pytest.mark.parametrize("mode", ["local-loss", "backprop"])
def test_modes_train_the_assembled_model(
    tmp_path: Path, store: RunStore, profile: ModelProfile, mode: str
) -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    hub = InProcessHub()
    big = 1 << 30
    run = config(tmp_path, mode=mode)
    edges = start_fleet(hub, tmp_path, dict.fromkeys(EDGES, big), {})
    assert Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile).run()
    rounds = store.list_rounds("svc-1")
    assert [r.state for r in rounds] == ["committed", "committed"]
    assert rounds[-1].evaluation["accuracy"] > 0.5, [r.evaluation for r in rounds]
    for record in rounds:
        assert all(r.failure is None and r.examples > 0 for r in record.results)
    # the GPU server counts what its stream carried (it counted its weights alone): the
    # edges' activations in, and in backprop their gradients out
    cut = {(m.name, m.device): m.value for m in store.metrics("svc-1") if m.round == 1}
    into, out = (cut[(f"cut_bytes_{way}", "gpu-a")] for way in ("received", "sent"))
    assert into == sum(cut[("cut_bytes_sent", e)] for e in EDGES) > 0
    assert out == sum(cut[("cut_bytes_received", e)] for e in EDGES)
    assert (out > 0) == (mode == "backprop")
    server = next(r for r in rounds[0].results if r.device == "gpu-a")
    assert server.bytes_received > into and server.bytes_sent > out
    if mode == "backprop":
        assert all(e._built is not None for e in edges)
        trainers = [e._built.trainer for e in edges if e._built is not None]
        assert all(t.rejected_gradients == 0 for t in trainers)
        assert all(t.config.mode == "backprop" for t in trainers)


def test_federated_evaluation_on_the_data_edges_hold_out(
    tmp_path: Path, store: RunStore, profile: ModelProfile
) -> None:
    hub = InProcessHub()
    run = config(tmp_path, federated_eval=0.2)
    start_fleet(hub, tmp_path, dict.fromkeys(EDGES, 1 << 30), {})
    assert Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile).run()
    rounds = store.list_rounds("svc-1")
    for record in rounds:
        evaluation = record.evaluation
        # each edge holds out 120 of its 600 digits and trains on the other 480
        assert evaluation["federated_examples"] == 240
        assert {r.examples for r in record.results if r.device in EDGES} == {480}
        assert 0 < evaluation["federated_accuracy"] <= 1 and evaluation["federated_loss"] > 0
    # the same model on other digits of the same distribution: close to the server's figure
    last = rounds[-1].evaluation
    assert last["federated_accuracy"] > 0.5
    assert abs(last["federated_accuracy"] - last["accuracy"]) < 0.15, last


def test_missing_devices_are_named_after_the_wait(tmp_path: Path, store: RunStore) -> None:
    hub = InProcessHub()
    run = config(tmp_path, devices={"edges": ["pi-01", "pi-09"], "wait": "1s"})
    start_fleet(hub, tmp_path, dict.fromkeys(EDGES, 1 << 30), {})
    with pytest.raises(CoordinatorError, match=r"pi-09 \(never announced\)"):
        Coordinator(run, store, hub.connect("coordinator")).run()
    assert store.get_run("svc-1").status == "failed"


def test_a_run_that_committed_no_round_starts_over_with_a_changed_config(
    tmp_path: Path, store: RunStore, profile: ModelProfile
) -> None:
    # its start failed (a device never came): nothing was trained with the old settings, so
    # the fixed config, another optimizer and model included, is taken and recorded
    hub = InProcessHub()
    missing = config(tmp_path, model="mlp", devices={"edges": ["pi-01", "pi-09"], "wait": "1s"})
    start_fleet(hub, tmp_path, dict.fromkeys(EDGES, 1 << 30), {})
    with pytest.raises(CoordinatorError, match="pi-09"):
        Coordinator(missing, store, hub.connect("c1")).run()
    fixed = config(tmp_path, rounds=1, optimizer={"name": "adam", "lr": 0.01})
    assert Coordinator(fixed, store, hub.connect("c2"), profile=lambda _: profile).run() == 1
    (event,) = [e for e in store.events("svc-1") if e.kind == "config-changed"]
    assert "model 'mlp' -> 'cnn'" in event.detail and "no round had been committed" in event.detail
    assert store.get_run("svc-1").config == fixed.to_dict()
    # once a round is committed, the same change is refused again
    with pytest.raises(ConfigError, match="another network"):
        Coordinator(missing, store, hub.connect("c3")).run()


class MqttHub:
    """``connect`` like the in-process hub's, on a real broker."""

    def __init__(self, broker: Broker) -> None:
        self.config = MqttConfig.from_url(broker.url, session_expiry=0, clean_start=True)
        self.made: list[MqttTransport] = []

    def connect(self, name: str, will: Will | None = None) -> Transport:
        self.made.append(MqttTransport(self.config, f"{name}-{uuid.uuid4().hex[:6]}", will))
        return self.made[-1]

    def close(self) -> None:
        for transport in self.made:
            transport.close()


@pytest.mark.parametrize("transport", ["in-process", "mqtt"])
def test_two_gpu_servers_share_the_streams_and_both_train(
    tmp_path: Path,
    store: RunStore,
    profile: ModelProfile,
    transport: str,
    request: pytest.FixtureRequest,
) -> None:
    hub = (
        InProcessHub() if transport == "in-process" else MqttHub(request.getfixturevalue("broker"))
    )
    run = config(tmp_path, devices={"edges": list(EDGES), "gpu_servers": 2, "wait": "30s"})
    start_fleet(hub, tmp_path, dict.fromkeys(EDGES, 1 << 30), {}, servers=("gpu-a", "gpu-b"))
    gpus = start_fleet.gpus  # type: ignore[attr-defined]
    assert Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile).run()
    rounds = store.list_rounds("svc-1")
    assert [r.state for r in rounds] == ["committed", "committed"]
    for record in rounds:
        results = {r.device: r for r in record.results}
        assert set(results) == {*EDGES, "gpu-a", "gpu-b"}
        assert all(r.failure is None for r in results.values()), results
        edge_examples = sum(results[e].examples for e in EDGES)
        # every batch was trained exactly once, by one of the two servers
        assert results["gpu-a"].examples + results["gpu-b"].examples == edge_examples
    per_server = [sum(g._backs["svc-1"][1].stats.per_device.values()) for g in gpus]
    assert all(count > 0 for count in per_server), per_server
    assert rounds[-1].evaluation["accuracy"] > 0.5
    if isinstance(hub, MqttHub):
        hub.close()


@pytest.mark.parametrize("transport", ["in-process", "mqtt"])
def test_a_back_too_big_for_one_server_is_chained_over_two(
    tmp_path: Path,
    store: RunStore,
    profile: ModelProfile,
    transport: str,
    request: pytest.FixtureRequest,
) -> None:
    problem = Problem.build(profile, PartitionConfig(batch_size=16, optimizer="adam"))
    last = profile.num_blocks
    # edges room for one block only; servers room for a piece of [1, N) but not all of it
    middle = min(range(2, last), key=lambda m: max(problem.memory[1][m], problem.memory[m][last]))
    room = int(max(problem.memory[1][middle], problem.memory[middle][last])) + 1024
    assert room < problem.memory[1][last]
    hub = (
        InProcessHub() if transport == "in-process" else MqttHub(request.getfixturevalue("broker"))
    )
    edge_room = dict.fromkeys(EDGES, int(problem.edge_memory[1]) + 1024)
    run = config(tmp_path, devices={"edges": list(EDGES), "gpu_servers": 2, "wait": "30s"})
    start_fleet(hub, tmp_path, edge_room, {}, ("gpu-a", "gpu-b"), server_memory=room)
    gpus = {g.device: g for g in start_fleet.gpus}  # type: ignore[attr-defined]

    assert Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile).run()

    plan = store.get_run("svc-1").plan
    assert plan is not None
    pieces = sorted(tuple(s["blocks"]) for s in plan["servers"])
    assert len(pieces) == 2 and pieces[0][0] == 1 and pieces[-1][1] == last, pieces
    assert pieces[0][1] == pieces[1][0]
    rounds = store.list_rounds("svc-1")
    assert [r.state for r in rounds] == ["committed", "committed"]
    for record in rounds:
        results = {r.device: r for r in record.results}
        assert all(r.failure is None for r in results.values()), results
        edge_examples = sum(results[e].examples for e in EDGES)
        # the first piece trains every edge batch and passes each on to the second
        assert results["gpu-a"].examples == results["gpu-b"].examples == edge_examples
    first = next(n for n, g in gpus.items() if g._backs["svc-1"][1].forward is not None)
    back = gpus[first]._backs["svc-1"][1]
    assert back.end == pieces[0][1] and back.stats.rejected == {}
    assert rounds[-1].evaluation["accuracy"] > 0.5, [r.evaluation for r in rounds]
    if isinstance(hub, MqttHub):
        hub.close()


def test_the_strategy_config_reaches_every_device_in_its_train_message(
    tmp_path: Path, store: RunStore, profile: ModelProfile
) -> None:
    hub = InProcessHub()
    run = config(tmp_path, rounds=1, strategy={"name": "fedprox", "proximal_mu": 0.25})
    start_fleet(hub, tmp_path, dict.fromkeys(EDGES, 1 << 30), {})
    received: dict[str, list[Message]] = {}
    tap = hub.connect("tap")
    for device in (*EDGES, "gpu-a"):
        frames = _Frames(tap)

        def seen(
            _topic: str, payload: bytes, device: str = device, frames: _Frames = frames
        ) -> None:
            if (message := frames.receive(payload)) is not None:
                received.setdefault(device, []).append(message)

        tap.subscribe(topics.flower_in(device), seen)

    assert Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile).run() == 1

    for device in (*EDGES, "gpu-a"):
        trains = [m for m in received[device] if m.metadata.message_type == "train"]
        assert len(trains) == 1, device
        options = trains[0].content.config_records["config"]
        assert options["proximal-mu"] == 0.25, (device, dict(options))
        assert options["server-round"] == 1 and "task" in options


def test_a_resume_that_changes_the_training_is_refused_unless_allowed(
    tmp_path: Path, store: RunStore, profile: ModelProfile
) -> None:
    first = config(tmp_path, rounds=1)  # writes the edges' data
    hub = InProcessHub()
    start_fleet(hub, tmp_path, dict.fromkeys(EDGES, 1 << 30), {})
    assert Coordinator(first, store, hub.connect("c1"), profile=lambda _: profile).run() == 1

    changed = config(
        tmp_path, rounds=2, batch_size=8, optimizer={"name": "adam", "lr": 0.01}, round_deadline=90
    )
    with pytest.raises(ConfigError, match=r"batch_size 16 -> 8; optimizer.lr 0.002 -> 0.01"):
        Coordinator(changed, store, hub.connect("c2"), profile=lambda _: profile).run()
    assert store.get_run("svc-1").config == first.to_dict(), "a refused resume changes nothing"
    with pytest.raises(ConfigError, match="another network: model 'cnn' -> 'mlp'"):
        Coordinator(config(tmp_path, model="mlp"), store, hub.connect("c3")).run()

    # more rounds and a longer deadline are no training change: resumed as it is
    longer = config(tmp_path, rounds=2, round_deadline=90)
    assert Coordinator(longer, store, hub.connect("c4"), profile=lambda _: profile).run() == 1
    assert store.get_run("svc-1").config["rounds"] == 2
    assert not [e for e in store.events("svc-1") if e.kind == "config-changed"]

    allowed = config(tmp_path, rounds=3, batch_size=8, optimizer={"name": "adam", "lr": 0.003})
    coordinator = Coordinator(
        allowed, store, hub.connect("c5"), profile=lambda _: profile, allow_config_change=True
    )
    assert coordinator.run() == 1
    (event,) = [e for e in store.events("svc-1") if e.kind == "config-changed"]
    assert "batch_size 16 -> 8" in event.detail and "optimizer.lr 0.002 -> 0.003" in event.detail
    assert store.get_run("svc-1").config == allowed.to_dict()


def test_an_edge_whose_weights_go_nan_is_left_out_and_no_nan_is_committed(
    tmp_path: Path, store: RunStore, profile: ModelProfile
) -> None:
    run = config(tmp_path, rounds=2)
    hub = InProcessHub()
    agents = start_fleet(hub, tmp_path, dict.fromkeys(EDGES, 1 << 30), {})
    # a broken sensor: the loaders refuse NaN, so the agent's data is replaced behind them
    data = agents[1].data
    agents[1].data = Dataset(np.full_like(data.x, np.nan), data.y, data.num_classes)
    assert Coordinator(run, store, hub.connect("c1"), profile=lambda _: profile).run() == 2

    for number in (1, 2):
        record = store.get_round("svc-1", number)
        failures = {r.device: r.failure for r in record.results if r.failure}
        assert "NaN" in (failures.get("pi-02") or ""), failures
        weights = store.checkpoint("svc-1", number).weights["global"]
        assert all(np.isfinite(v).all() for v in weights.values()), number
    assert store.get_round("svc-1", 2).evaluation["accuracy"] > 0.3
    diverged = [e for e in store.events("svc-1") if e.kind == "device-diverged"]
    # an event each round (each try that aggregated: a retried round has two), naming the
    # edge and what to try
    assert {e.round for e in diverged} == {1, 2}, diverged
    assert all(e.detail.startswith("pi-02 sent weights holding NaN") for e in diverged)
    assert {e.device for e in diverged} == {"pi-02"}
    assert "a lower lr, or the optimizer's max_step" in diverged[0].detail
    gpu = start_fleet.gpus[0]  # type: ignore[attr-defined]
    assert gpu._backs["svc-1"][1].stats.rejected["non_finite"] > 0, "NaN batches rejected"
