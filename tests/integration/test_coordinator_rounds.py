"""The coordinator's round loop commits every round to the store and resumes after a stop."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from coordinator.aggregation import build_strategy
from coordinator.rounds import run_rounds
from edge_client import EdgeTrainer, EdgeTrainerConfig
from edge_client.app import edge_app
from gpu_server import BackTrainer
from gpu_server.app import gpu_app
from split_models import OptimizerConfig, Segment, build_model, load_dataset, partition
from split_models.weights import load_segment_state, segment_state
from storage import open_store
from wire.channel import Channel
from wire.flow import CreditGate
from wire.flower import FlowerNode, TransportGrid, node_will
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_mnist.npz"
EDGES = {"pi-01": (1, 1), "pi-02": (2, 2)}
RUN = "resume-1"


def test_rounds_are_committed_and_a_restarted_coordinator_continues(tmp_path: Path) -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    optimizer = OptimizerConfig("sgd-momentum", lr=0.05)
    train, test = load_dataset(f"npz:{FIXTURE}").split(0.2, seed=0)
    hub = InProcessHub()
    back = BackTrainer(
        Channel(hub.connect("gpu-data"), "gpu-a"),
        build_model("cnn", (1, 28, 28), 10, seed=0),
        start=1,
        run=RUN,
        segment="seg-0",
        optimizer=optimizer,
    )
    FlowerNode(hub.connect("gpu-flower", node_will(3)), 3, gpu_app(back, list(EDGES), 60))
    initial = back.state()
    for (device, (node, cut)), indices in zip(EDGES.items(), partition(train.y, 2), strict=True):
        channel = Channel(hub.connect(f"{device}-data"), device)
        segment = Segment.from_model(
            build_model("cnn", (1, 28, 28), 10, seed=0), 0, cut, "linear", optimizer
        )
        initial |= segment_state(segment)
        trainer = EdgeTrainer(
            channel,
            CreditGate(channel, RUN, device),
            segment,
            train.subset(indices),
            EdgeTrainerConfig(RUN, device, "seg-0"),
        )
        FlowerNode(hub.connect(f"{device}-flower", node_will(node)), node, edge_app(trainer))

    def evaluate(weights: dict[str, np.ndarray]) -> dict[str, float]:
        model = build_model("cnn", (1, 28, 28), 10, seed=0)
        whole = Segment.from_model(model, 0, model.num_blocks)
        load_segment_state(whole, weights)
        logits = whole.forward(torch.from_numpy(test.x))
        return {"accuracy": float((logits.argmax(1).numpy() == test.y).mean())}

    def coordinator(rounds: int, name: str) -> int:
        grid = TransportGrid(hub.connect(name))
        assert grid.wait_for_nodes(3, timeout=10) == [1, 2, 3]
        strategy = build_strategy(
            "fedavg", fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3
        )
        with open_store(str(tmp_path / "runs.db")) as store:
            return run_rounds(store, RUN, strategy, grid, initial, rounds, list(EDGES), evaluate)

    with open_store(str(tmp_path / "runs.db")) as store:
        store.create_run(RUN, {"rounds": 3}, seed=0)
    assert coordinator(2, "coordinator-a") == 2  # it stops after two rounds
    with open_store(str(tmp_path / "runs.db")) as store:
        assert store.get_run(RUN).current_round == 2
        after_two = store.checkpoint(RUN, 2).weights["global"]
    assert coordinator(3, "coordinator-b") == 1, "a restart runs only what is left"
    assert coordinator(3, "coordinator-c") == 0
    with open_store(str(tmp_path / "runs.db")) as store:
        run = store.get_run(RUN)
        rounds = store.list_rounds(RUN)
        third = store.checkpoint(RUN, 3).weights["global"]
        assert store.integrity_problems(deep=True) == []
    assert run.status == "finished" and run.current_round == 3
    assert [(r.number, r.state) for r in rounds] == [
        (1, "committed"),
        (2, "committed"),
        (3, "committed"),
    ]
    assert all("accuracy" in r.evaluation for r in rounds)
    assert back.stats.examples == 3 * len(train), "three rounds of every edge's data"
    assert not np.array_equal(third["block0.0.weight"], after_two["block0.0.weight"])
