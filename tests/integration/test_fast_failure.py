"""Fast failure detection with the real agents (in-process broker): an edge whose last will
arrives mid-round ends its part of the round on the GPU server at once (the server's reply
names it ``gone``, and what of it arrived before the will is in the back: all in), and edges
whose GPU server went offline give the round up with an error naming it."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Message, RecordDict

from edge_client import EdgeTrainer, EdgeTrainerConfig
from edge_client.agent import EdgeAgent
from edge_client.source import OwnSegment, SegmentLease
from split_models import Dataset, Segment, StepResult, build_model
from tests.integration import split_fleet
from tests.unit.test_session import _until
from wire import topics
from wire.channel import Channel
from wire.flow import CreditGate
from wire.flower import TRAINED_RECORD, TransportGrid, array_record, node_will
from wire.roles import Announcement, node_id_for
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration

DEAD, BATCH, BEFORE = "pi-03", 8, 2  # the edge killed after BEFORE batches


def _blocked_after(segment: Segment, count: int, go: threading.Event) -> Callable[..., StepResult]:
    calls = [0]

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        calls[0] += 1
        if calls[0] > count:
            go.wait(60.0)  # the process is "dead" from here on
        return segment.train_step(inputs, labels)

    return step


def _dying_edge(hub: InProcessHub, run: str) -> EdgeTrainer:
    rng = np.random.default_rng(3)
    data = Dataset(
        rng.normal(size=(4 * BATCH, 1, 28, 28)).astype(np.float32),
        rng.integers(0, 10, size=4 * BATCH).astype(np.int64),
        10,
    )
    channel = Channel(hub.connect(DEAD), DEAD)
    segment = Segment.from_model(build_model(*split_fleet.MODEL, seed=0), 0, 1)
    config = EdgeTrainerConfig(run, DEAD, "seg-0", batch_size=BATCH, credit_timeout=60.0)
    return EdgeTrainer(channel, CreditGate(channel, run, DEAD), segment, data, config)


def _watch_stream(hub: InProcessHub, run: str) -> threading.Event:
    """Set once DEAD publishes a batch of ``run`` (watched beside the server's subscription)."""
    sent = threading.Event()
    Channel(hub.connect("watcher"), "watcher").listen(
        topics.activations(run, "seg-0", DEAD),
        lambda _t, _e: sent.set(),
        kinds=frozenset({"activations"}),
    )
    return sent


def _train(fleet: split_fleet.Fleet, grid: object, nodes: list[int]) -> list[Message]:
    config = ConfigRecord({"server-round": 1})
    content = RecordDict({"arrays": array_record(fleet.initial), "config": config})
    messages = [grid.create_message(content, "train", n, "ff") for n in nodes]  # type: ignore[attr-defined]
    return list(grid.send_and_receive(messages, timeout=split_fleet.DEADLINE))  # type: ignore[attr-defined]


def _digits(count: int, seed: int) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 1, 28, 28)).astype(np.float32)
    return Dataset(x, rng.integers(0, 10, size=count).astype(np.int64), 10)


@pytest.mark.parametrize("restarted", [False, True], ids=["killed", "restarted-at-once"])
def test_a_gpu_server_ends_the_part_of_an_edge_whose_last_will_arrives(restarted: bool) -> None:
    # restarted: a new process of the edge says online within the will's grace; the round's
    # part of the old one ends all the same, at once
    hub = InProcessHub()
    data = {"pi-01": _digits(32, 0), "pi-02": _digits(32, 1)}
    fleet = split_fleet.start_fleet(hub.connect, data["pi-01"], "ff-1", data)
    gpu = node_id_for(split_fleet.GPU)
    edges = (*split_fleet.EDGES, DEAD)
    fleet.tasks[gpu] = dataclasses.replace(fleet.tasks[gpu], edges=edges)
    control = hub.connect(f"{DEAD}-control", node_will(node_id_for(DEAD), DEAD))
    online = f"online {node_id_for(DEAD)}"
    control.publish(topics.presence(DEAD), f"{online} {'a' * 16}".encode(), retain=True)
    dying, go = _dying_edge(hub, "ff-1"), threading.Event()
    step = _blocked_after(dying.segment, BEFORE, go)
    threading.Thread(target=lambda: dying.train_round(1, step=step), daemon=True).start()
    transport_grid = TransportGrid(hub.connect("coordinator"))
    transport_grid.wait_for_nodes(3, timeout=10)
    replies: list[Message] = []
    asked = threading.Thread(
        target=lambda: replies.extend(_train(fleet, fleet.grid(transport_grid), fleet.node_ids))
    )
    asked.start()
    _until(lambda: fleet.gpu.trainer("ff-1") is not None, 30.0)
    # received (the fill may hold small batches until the round's end before training them)
    _until(lambda: fleet.back.stream.stats.handled[DEAD] == BEFORE, 30.0)

    control.kill()  # the edge dies: the broker publishes its last will
    killed = time.monotonic()
    if restarted:
        again = hub.connect(f"{DEAD}-control-2", node_will(node_id_for(DEAD), DEAD))
        again.publish(topics.presence(DEAD), f"{online} {'b' * 16}".encode(), retain=True)
    asked.join(split_fleet.DEADLINE)
    assert time.monotonic() - killed < 10.0, "the round ended within seconds of the kill"
    late = _watch_stream(hub, "ff-1")
    go.set()  # a batch the dead edge had in flight is sent after its will, the round over
    assert late.wait(10.0), "the dead edge's last batch was not sent"

    by_node = {r.metadata.src_node_id: r for r in replies}
    assert set(by_node) == set(fleet.node_ids) and not any(r.has_error() for r in replies)
    report = by_node[gpu].content.config_records["report"]
    assert report["gone"] == DEAD and report["late"] == ""
    assert report["finished"] == ",".join(split_fleet.EDGES)
    assert fleet.back.stream.stats.left == {DEAD: 1}, "ended by the offline path"
    trained = by_node[gpu].content.config_records[TRAINED_RECORD]
    assert trained[DEAD] == BEFORE * BATCH, "all of the dead edge's batches that came are in"
    time.sleep(0.2)  # were the server still taking the stream, the late batch would be in
    assert fleet.back.stats.per_device[DEAD] == BEFORE * BATCH, "none after its will"


def test_edges_give_a_round_up_naming_the_gpu_server_that_went_offline() -> None:
    hub = InProcessHub()
    data = {"pi-01": _digits(32, 0), "pi-02": _digits(32, 1)}
    fleet = split_fleet.start_fleet(hub.connect, data["pi-01"], "ff-2", data)
    edges = [node_id_for(d) for d in split_fleet.EDGES]
    for node in edges:  # as the coordinator does: the servers of the edge's stream
        fleet.tasks[node] = dataclasses.replace(fleet.tasks[node], servers=(split_fleet.GPU,))
    transport_grid = TransportGrid(hub.connect("coordinator"))
    transport_grid.wait_for_nodes(3, timeout=10)

    fleet.gpu.node.transport.kill()  # the GPU server dies before the round: no credit comes
    replies = _train(fleet, fleet.grid(transport_grid), edges)

    assert len(replies) == 2 and all(r.has_error() for r in replies)
    for reply in replies:
        assert f"GPU server {split_fleet.GPU} went offline" in reply.error.reason


def _fleet_serving_dead(hub: InProcessHub, run: str) -> tuple[split_fleet.Fleet, int]:
    """The fleet of ``run`` with its GPU server expecting DEAD's batches too; the server's
    node."""
    data = {"pi-01": _digits(32, 0), "pi-02": _digits(32, 1)}
    fleet = split_fleet.start_fleet(hub.connect, data["pi-01"], run, data)
    gpu = node_id_for(split_fleet.GPU)
    fleet.tasks[gpu] = dataclasses.replace(fleet.tasks[gpu], edges=(*split_fleet.EDGES, DEAD))
    return fleet, gpu


def _others_send_nothing(hub: InProcessHub, run: str) -> None:
    """The fleet's own edges have nothing to send in round 1 (their ``done`` of 0)."""
    for edge in split_fleet.EDGES:
        channel = Channel(hub.connect(f"{edge}-done"), edge)
        meta = {"batches": 0, "attempt": 1}
        channel.send(topics.done(run, edge), "round_control", run, round=1, meta=meta)


def _failing_round(edge: EdgeTrainer, errors: list[BaseException]) -> None:
    """One round of ``edge`` whose step raises after BEFORE batches; the error kept."""
    calls = [0]

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        calls[0] += 1
        if calls[0] > BEFORE:
            raise IndexError("index out of range in self")
        return edge.segment.train_step(inputs, labels)

    try:
        edge.train_round(1, step=step)
    except IndexError as error:
        errors.append(error)


def test_an_edge_whose_training_fails_mid_round_ends_its_part_at_once() -> None:
    # the step raises after BEFORE batches (a bad token id, a bug in a user's model): the
    # edge tells the servers how many batches went out, and the round does not wait for the
    # rest until its deadline
    hub = InProcessHub()
    fleet, gpu = _fleet_serving_dead(hub, "ff-3")
    failing, errors = _dying_edge(hub, "ff-3"), list[BaseException]()
    transport_grid = TransportGrid(hub.connect("coordinator"))
    transport_grid.wait_for_nodes(3, timeout=10)
    replies: list[Message] = []
    asked = threading.Thread(
        target=lambda: replies.extend(_train(fleet, fleet.grid(transport_grid), [gpu]))
    )
    began = time.monotonic()
    asked.start()
    _until(lambda: fleet.gpu.trainer("ff-3") is not None, 30.0)
    threading.Thread(target=_failing_round, args=(failing, errors), daemon=True).start()
    _others_send_nothing(hub, "ff-3")
    asked.join(split_fleet.DEADLINE)

    assert time.monotonic() - began < 20.0, "the round waited for its deadline"
    assert len(errors) == 1, "the edge's own round still fails, with the step's error"
    assert len(replies) == 1 and not replies[0].has_error()
    report = replies[0].content.config_records["report"]
    assert DEAD in str(report["finished"]).split(",") and report["gone"] == ""
    trained = replies[0].content.config_records[TRAINED_RECORD]
    assert trained[DEAD] == BEFORE * BATCH, "the batches it sent before failing are in"


class _Unbuildable(OwnSegment):
    """A segment source that fails as building a segment that does not fit would."""

    def lease(self, *args: object, **kwargs: object) -> Iterator[SegmentLease]:  # type: ignore[override]
        raise RuntimeError("could not build the segment: out of memory")


def test_an_edge_whose_round_fails_before_training_ends_its_part_at_once() -> None:
    # the lease (building and loading the segment) fails before the trainer starts: the edge
    # says it sends nothing, and the server does not wait for it until the round's deadline
    hub = InProcessHub()
    fleet, gpu = _fleet_serving_dead(hub, "ff-4")
    fleet.tasks[node_id_for(DEAD)] = dataclasses.replace(fleet.tasks[node_id_for("pi-01")], end=1)
    EdgeAgent(
        Announcement(DEAD, "edge", 1 << 32, 1e9, 1e7),
        _digits(32, 2),
        hub.connect(f"{DEAD}-control", node_will(node_id_for(DEAD), DEAD)),
        hub.connect(f"{DEAD}-stream"),
        measure_peak=False,
        source=_Unbuildable(),
    )
    transport_grid = TransportGrid(hub.connect("coordinator"))
    transport_grid.wait_for_nodes(4, timeout=10)
    replies: list[Message] = []
    nodes = [gpu, node_id_for(DEAD)]
    asked = threading.Thread(
        target=lambda: replies.extend(_train(fleet, fleet.grid(transport_grid), nodes))
    )
    began = time.monotonic()
    asked.start()
    _until(lambda: fleet.gpu.trainer("ff-4") is not None, 30.0)
    _others_send_nothing(hub, "ff-4")
    asked.join(split_fleet.DEADLINE)

    assert time.monotonic() - began < 20.0, "the round waited for its deadline"
    by_node = {r.metadata.src_node_id: r for r in replies}
    assert "out of memory" in by_node[node_id_for(DEAD)].error.reason
    report = by_node[gpu].content.config_records["report"]
    assert DEAD in str(report["finished"]).split(",") and report["late"] == ""
