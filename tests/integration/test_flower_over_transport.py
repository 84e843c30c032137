"""Flower strategies drive rounds over edgesplit transports; MQTT equals in-process."""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from wire.arrays import numpy_arrays
from wire.broker import Broker
from wire.flower import FlowerNode, TransportGrid, node_will
from wire.mqtt import MqttConfig, MqttTransport
from wire.transport import InProcessHub, Transport, Will

NODES = (1, 2, 3)
ROUNDS = 2
INITIAL = [np.zeros((4, 3), dtype=np.float32), np.arange(5, dtype=np.float32)]

app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    """A deterministic 'training': every node moves the weights by its own amount."""
    # not ArrayRecord.to_numpy_ndarrays(): its np.load parses the header with ast, which on
    # CPython 3.11.7 fails now and then in threads (the nodes here): see wire.arrays
    arrays = list(numpy_arrays(message).values())
    node = context.node_id
    updated = [
        a + node * (1 + np.arange(a.size, dtype=np.float32).reshape(a.shape)) for a in arrays
    ]
    content = RecordDict(
        {
            "arrays": ArrayRecord(updated),
            "metrics": MetricRecord({"num-examples": 10 * node, "loss": 1.0 / node}),
        }
    )
    return Message(content=content, reply_to=message)


def oracle() -> list[np.ndarray]:
    weights = [a.copy() for a in INITIAL]
    examples = np.array([10 * n for n in NODES], dtype=np.float64)
    for _ in range(ROUNDS):
        updates = [
            [w + n * (1 + np.arange(w.size, dtype=np.float32).reshape(w.shape)) for w in weights]
            for n in NODES
        ]
        weights = [
            np.sum([u[i] * e for u, e in zip(updates, examples, strict=True)], axis=0)
            / examples.sum()
            for i in range(len(weights))
        ]
    return weights


def federate(connect: Callable[[str, Will | None], Transport]) -> list[np.ndarray]:
    grid = TransportGrid(connect("coordinator", None))
    nodes = [FlowerNode(connect(f"node-{n}", node_will(n)), n, app) for n in NODES]
    assert grid.wait_for_nodes(len(NODES), timeout=10) == list(NODES)
    strategy = FedAvg(
        fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3
    )
    result = strategy.start(
        grid=grid, initial_arrays=ArrayRecord(INITIAL), num_rounds=ROUNDS, timeout=60
    )
    assert all(node.handled == ROUNDS for node in nodes)
    return result.arrays.to_numpy_ndarrays()


@pytest.fixture(autouse=True)
def quiet_flower() -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)


@pytest.mark.integration
def test_fedavg_over_mqtt_equals_in_process_and_the_oracle(broker: Broker) -> None:
    hub = InProcessHub()
    in_process = federate(lambda name, will: hub.connect(name, will))
    config = MqttConfig.from_url(broker.url)
    made: list[MqttTransport] = []

    def mqtt(name: str, will: Will | None) -> Transport:
        made.append(MqttTransport(config, f"{name}-{uuid.uuid4().hex[:6]}", will))
        return made[-1]

    try:
        over_mqtt = federate(mqtt)
    finally:
        for transport in made:
            transport.close()
    for a, b, expected in zip(over_mqtt, in_process, oracle(), strict=True):
        assert np.array_equal(a, b), "MQTT and in-process rounds must agree exactly"
        np.testing.assert_allclose(a, expected, rtol=1e-6)
