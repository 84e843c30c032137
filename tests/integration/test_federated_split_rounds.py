"""Federated split rounds end to end in one process: a Flower strategy drives two edges with
different cuts and a GPU server; the assembled model is evaluated after every round."""

from __future__ import annotations

import logging
import uuid
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, MetricRecord

from coordinator.aggregation import build_strategy
from split_models import load_dataset
from tests.integration.split_fleet import Connect, accuracy, start_fleet
from wire.broker import Broker
from wire.flower import TransportGrid, array_record
from wire.mqtt import MqttConfig, MqttTransport
from wire.transport import InProcessHub, Transport, Will

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_mnist.npz"
SHARED = Path(__file__).resolve().parents[3] / "shared" / "data" / "mnist8k.npz"
RUN, ROUNDS = "fed-1", 3


def run_rounds(
    spec: str, samples: int, connect: Connect | None = None
) -> tuple[dict[int, float], dict[str, np.ndarray], dict[str, np.ndarray], int, int]:
    """(accuracy by round, initial weights, final weights, GPU examples, training samples)."""
    logging.getLogger("flwr").setLevel(logging.WARNING)
    data = load_dataset(spec)
    data = data.subset(np.arange(min(len(data), samples)))
    train, test = data.split(0.2, seed=0)
    if connect is None:
        connect = InProcessHub().connect

    fleet = start_fleet(connect, train, RUN)

    def evaluate(_round: int, arrays: ArrayRecord) -> MetricRecord:
        return MetricRecord({"accuracy": accuracy({k: v.numpy() for k, v in arrays.items()}, test)})

    grid = TransportGrid(connect("coordinator"))
    assert grid.wait_for_nodes(3, timeout=10) == fleet.node_ids
    strategy = build_strategy(
        "fedavg", fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3
    )
    result = strategy.start(
        grid=fleet.grid(grid),
        initial_arrays=array_record(fleet.initial),
        num_rounds=ROUNDS,
        timeout=300,
        evaluate_fn=evaluate,
    )

    by_round = {r: float(m["accuracy"]) for r, m in result.evaluate_metrics_serverapp.items()}
    for node in fleet.nodes:
        node.transport.close()
    final = {k: v.numpy() for k, v in result.arrays.items()}
    return by_round, fleet.initial, final, fleet.back.stats.examples, len(train)


def test_rounds_train_every_block_of_every_device() -> None:
    accuracy, initial, final, gpu_examples, samples = run_rounds(f"npz:{FIXTURE}", 240)
    assert sorted(accuracy) == list(range(ROUNDS + 1)), "evaluated before and after each round"
    assert gpu_examples == ROUNDS * samples, "the GPU trained every batch of every edge"
    assert {"head1.net.1.weight", "head2.net.1.weight"} <= set(final)
    for key in ("block0.0.weight", "block1.0.weight", "block5.0.weight"):
        assert not np.array_equal(final[key], initial[key]), f"{key} was trained"


def test_rounds_over_mqtt(broker: Broker) -> None:
    config = MqttConfig.from_url(broker.url)
    made: list[MqttTransport] = []

    def connect(name: str, will: Will | None = None) -> Transport:
        made.append(MqttTransport(config, f"{name}-{uuid.uuid4().hex[:6]}", will))
        return made[-1]

    try:
        accuracy, initial, final, gpu_examples, samples = run_rounds(f"npz:{FIXTURE}", 240, connect)
    finally:
        for transport in made:
            transport.close()
    assert sorted(accuracy) == list(range(ROUNDS + 1))
    assert gpu_examples == ROUNDS * samples
    assert not np.array_equal(final["block0.0.weight"], initial["block0.0.weight"])


@pytest.mark.skipif(not SHARED.exists(), reason="needs ../shared/data/mnist8k.npz")
def test_accuracy_rises_over_rounds_on_real_digits() -> None:
    accuracy, *_ = run_rounds(f"npz:{SHARED}", 2400)
    print(f"accuracy by round: {accuracy}")
    assert accuracy[ROUNDS] > accuracy[0] + 0.5, accuracy
