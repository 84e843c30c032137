"""The round engine, over whole-model messages, commits every round to the store and resumes
after a stop."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import pytest

from coordinator.aggregation import build_strategy
from coordinator.federated import run_federated
from split_models import load_dataset
from storage import open_store
from tests.integration.split_fleet import EDGES, GPU, accuracy, start_fleet
from wire.flower import TransportGrid
from wire.roles import node_id_for
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_mnist.npz"
RUN = "resume-1"


def test_rounds_are_committed_and_a_restarted_coordinator_continues(tmp_path: Path) -> None:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    train, test = load_dataset(f"npz:{FIXTURE}").split(0.2, seed=0)
    hub = InProcessHub()
    fleet = start_fleet(hub.connect, train, RUN)
    initial = fleet.initial
    nodes = {name: node_id_for(name) for name in (GPU, *EDGES)}

    def evaluate(weights: dict[str, np.ndarray]) -> dict[str, float]:
        return {"accuracy": accuracy(weights, test)}

    def coordinator(rounds: int, name: str) -> int:
        grid = TransportGrid(hub.connect(name))
        assert grid.wait_for_nodes(3, timeout=10) == fleet.node_ids
        strategy = build_strategy(
            "fedavg", fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3
        )
        with open_store(str(tmp_path / "runs.db")) as store:
            return run_federated(
                store, RUN, strategy, fleet.grid(grid), initial, rounds, nodes, evaluate
            )

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
    assert fleet.back.stats.examples == 3 * len(train), "three rounds of every edge's data"
    assert not np.array_equal(third["block0.0.weight"], after_two["block0.0.weight"])
