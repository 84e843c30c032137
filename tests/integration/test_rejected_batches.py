"""A batch rejected at any layer costs one batch, never a deadline: an edge whose last batch
carries NaN activations (the codec rejects it at the GPU server) gets its credit back, and the
round ends at once, with one GPU server and with two sharing the stream. Over the in-process
transport and a real mosquitto, with the real edge and GPU server trainers."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, RecordDict

from edge_client import EdgeRoundReport, EdgeTrainer, EdgeTrainerConfig
from gpu_server import BackTrainer
from split_models import Dataset, OptimizerConfig, Segment, StepResult, build_model
from tests.integration import split_fleet
from tests.integration.mqtt_clients import mqtt_clients
from wire.broker import Broker
from wire.channel import Channel
from wire.flow import CreditGate
from wire.flower import TransportGrid, array_record
from wire.roles import node_id_for
from wire.transport import InProcessHub, Transport

pytestmark = pytest.mark.integration

DEADLINE = 30.0  # the servers' wait; the round must end far sooner
BATCHES, BATCH = 4, 8
EDGE, CUT, WINDOW = "pi-01", 1, 2


def _nan_last(segment: Segment) -> Callable[[torch.Tensor, torch.Tensor], StepResult]:
    """The segment's own step, whose output on the round's last batch is NaN."""
    calls = [0]

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        calls[0] += 1
        result = segment.train_step(inputs, labels)
        if calls[0] == BATCHES:
            return StepResult(torch.full_like(result.output, float("nan")), result.loss)
        return result

    return step


def _edge(connect: Callable[[str], Transport], run: str) -> EdgeTrainer:
    rng = np.random.default_rng(0)
    data = Dataset(
        rng.normal(size=(BATCHES * BATCH, 1, 28, 28)).astype(np.float32),
        rng.integers(0, 10, size=BATCHES * BATCH).astype(np.int64),
        10,
    )
    channel = Channel(connect(EDGE), EDGE)
    segment = Segment.from_model(build_model("cnn", (1, 28, 28), 10, seed=0), 0, CUT)
    config = EdgeTrainerConfig(run, EDGE, "seg-0", batch_size=BATCH, credit_timeout=DEADLINE)
    return EdgeTrainer(channel, CreditGate(channel, run, EDGE), segment, data, config)


def _servers(connect: Callable[[str], Transport], run: str, count: int) -> list[BackTrainer]:
    return [
        BackTrainer(
            Channel(connect(f"gpu-{index}"), f"gpu-{index}"),
            build_model("cnn", (1, 28, 28), 10, seed=0),
            start=CUT,
            run=run,
            segment="seg-0",
            optimizer=OptimizerConfig("sgd", lr=0.01),
            window=WINDOW,
        )
        for index in range(count)
    ]


def _nan_last_batch_round(connect: Callable[[str], Transport], servers: int) -> None:
    run = f"run-{uuid.uuid4().hex[:6]}"
    backs = _servers(connect, run, servers)
    edge = _edge(connect, run)
    names = [f"gpu-{index}" for index in range(servers)]
    time.sleep(0.3)  # subscriptions reach the broker
    reports: list[EdgeRoundReport] = []
    started = time.monotonic()
    for back in backs:
        back.begin_round(1, [EDGE], peers=names)
    thread = threading.Thread(
        target=lambda: reports.append(edge.train_round(1, step=_nan_last(edge.segment)))
    )
    thread.start()
    results = [back.wait_round([EDGE], timeout=DEADLINE) for back in backs]
    elapsed = time.monotonic() - started
    thread.join(DEADLINE)

    assert elapsed < DEADLINE / 3, f"the round waited {elapsed:.1f} s for a rejected batch"
    assert reports and reports[0].batches == BATCHES
    assert all(back.finished == {EDGE} for back in backs), "every server agrees it ended"
    assert sum(back.stats.rejected["non_finite"] for back in backs) == 1
    assert sum(examples for examples, _ in results) == (BATCHES - 1) * BATCH
    deadline = time.monotonic() + 10  # the rejected batch's credit came back too
    while edge.gate.available < servers * WINDOW and time.monotonic() < deadline:
        time.sleep(0.05)
    assert edge.gate.available == servers * WINDOW


@pytest.mark.parametrize("servers", [1, 2])
def test_a_nan_last_batch_costs_one_batch_in_process(servers: int) -> None:
    hub = InProcessHub()
    _nan_last_batch_round(lambda name: hub.connect(name), servers)


@pytest.mark.parametrize("servers", [1, 2])
def test_a_nan_last_batch_costs_one_batch_over_mqtt(broker: Broker, servers: int) -> None:
    with mqtt_clients(broker) as connect:
        _nan_last_batch_round(connect, servers)


def _digits(count: int, seed: int, nan: bool = False) -> Dataset:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(count, 1, 28, 28)).astype(np.float32)
    if nan:
        x[0, 0, 0, 0] = np.nan  # the edge's activations of its only batch are NaN
    return Dataset(x, rng.integers(0, 10, size=count).astype(np.int64), 10)


def test_agents_end_a_round_whose_only_batch_of_an_edge_is_nan() -> None:
    hub = InProcessHub()
    data = {"pi-01": _digits(64, 0), "pi-02": _digits(16, 1, nan=True)}  # one batch of 32
    fleet = split_fleet.start_fleet(hub.connect, data["pi-01"], "nan-1", data)
    transport_grid = TransportGrid(hub.connect("coordinator"))
    assert transport_grid.wait_for_nodes(3, timeout=10) == fleet.node_ids
    grid = fleet.grid(transport_grid)
    content = RecordDict(
        {"arrays": array_record(fleet.initial), "config": ConfigRecord({"server-round": 1})}
    )
    messages = [grid.create_message(content, "train", node, "nan") for node in fleet.node_ids]
    started = time.monotonic()
    replies = list(grid.send_and_receive(messages, timeout=split_fleet.DEADLINE))
    elapsed = time.monotonic() - started

    assert elapsed < split_fleet.DEADLINE / 4, f"the round took {elapsed:.1f} s"
    by_node = {reply.metadata.src_node_id: reply for reply in replies}
    assert set(by_node) == set(fleet.node_ids) and not any(r.has_error() for r in replies)
    report = by_node[node_id_for(split_fleet.GPU)]
    assert report.content.config_records["report"]["late"] == ""
    assert fleet.back.stats.rejected["non_finite"] == 1
    assert fleet.back.stats.examples == 64, "pi-01's batches trained, pi-02's rejected"
