"""A small federated split fleet for tests: one GPU server and two edges with different cuts,
each a Flower node on the given transport factory, plus held-out accuracy of a weight set."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np

from edge_client import EdgeTrainer, EdgeTrainerConfig
from edge_client.app import edge_app
from gpu_server import BackTrainer
from gpu_server.app import gpu_app
from split_models import Dataset, OptimizerConfig, Segment, build_model, partition
from split_models.evaluation import evaluate_weights
from split_models.weights import segment_state
from wire.channel import Channel
from wire.flow import CreditGate
from wire.flower import FlowerNode, node_will
from wire.transport import Transport

EDGES = {"pi-01": (1, 1), "pi-02": (2, 2)}  # device -> (Flower node id, cut)
GPU_NODE = 3
OPTIMIZER = OptimizerConfig("sgd-momentum", lr=0.02)
Connect = Callable[..., Transport]


@dataclass
class Fleet:
    back: BackTrainer
    nodes: list[FlowerNode]
    initial: dict[str, np.ndarray]  # every device's starting tensors under global names


def start_fleet(connect: Connect, train: Dataset, run: str) -> Fleet:
    """GPU server (blocks from the shallowest cut) and the edges, all online as Flower nodes."""
    back = BackTrainer(
        Channel(connect("gpu-data"), "gpu-a"),
        build_model("cnn", (1, 28, 28), 10, seed=0),
        start=min(cut for _, cut in EDGES.values()),
        run=run,
        segment="seg-0",
        optimizer=OPTIMIZER,
    )
    nodes = [
        FlowerNode(
            connect("gpu-flower", node_will(GPU_NODE)),
            GPU_NODE,
            gpu_app(back, list(EDGES), round_timeout=120),
        )
    ]
    initial = back.state()
    for (device, (node, cut)), indices in zip(
        EDGES.items(), partition(train.y, 2, seed=0), strict=True
    ):
        channel = Channel(connect(f"{device}-data"), device)
        segment = Segment.from_model(
            build_model("cnn", (1, 28, 28), 10, seed=0), 0, cut, "linear", OPTIMIZER
        )
        initial |= segment_state(segment)
        trainer = EdgeTrainer(
            channel,
            CreditGate(channel, run, device),
            segment,
            train.subset(indices),
            EdgeTrainerConfig(run, device, "seg-0"),
        )
        nodes.append(
            FlowerNode(connect(f"{device}-flower", node_will(node)), node, edge_app(trainer))
        )
    return Fleet(back, nodes, initial)


def accuracy(weights: Mapping[str, np.ndarray], test: Dataset) -> float:
    """Held-out accuracy of the whole model assembled from ``weights``."""
    return evaluate_weights("cnn", (1, 28, 28), 10, weights, test)["accuracy"]
