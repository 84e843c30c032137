"""Baselines for ``edgesplit simulate``, in the same harness and outputs as the split methods.

- ``fedavg``: every client trains the whole model on its own data each round; a Flower FedAvg
  strategy (over the same in-process Flower transport) averages the models. Clients whose
  memory the whole model's training exceeds are flagged in the report (they train anyway: this
  is a simulation of what would not fit).
- ``centralized``: one process, the pooled training data, end-to-end back-propagation, one
  "round" per ``local_epochs`` epochs.

Both commit every round to the run store like the split methods.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from coordinator.aggregation import build_strategy
from coordinator.rounds import run_rounds
from split_models.data import Dataset
from split_models.evaluation import evaluate_weights
from split_models.memory import estimate_segment_memory
from split_models.segment import OptimizerConfig, Segment
from split_models.weights import load_segment_state, segment_state
from split_models.zoo import build_model
from storage.base import RunStore
from storage.records import DeviceResult
from wire.flower import (
    FlowerNode,
    TransportGrid,
    array_record,
    node_will,
    numpy_arrays,
    round_of,
)
from wire.transport import InProcessHub

__all__ = ["train_centralized", "train_fedavg"]

log = logging.getLogger(__name__)


def _whole(raw: dict[str, Any]) -> Segment:
    model = build_model(raw["model"], raw["input_shape"], raw["num_classes"], seed=raw["seed"])
    return Segment.from_model(
        model, 0, model.num_blocks, optimizer=OptimizerConfig(**raw["optimizer"])
    )


def _epochs(segment: Segment, data: Dataset, raw: dict[str, Any], seed: int) -> float:
    """``local_epochs`` shuffled passes; the mean loss."""
    generator = np.random.default_rng(seed)
    losses = []
    batch = int(raw["batch_size"])
    for _ in range(int(raw["local_epochs"])):
        order = generator.permutation(len(data))
        for begin in range(0, len(order), batch):
            rows = order[begin : begin + batch]
            result = segment.train_step(
                torch.from_numpy(data.x[rows]), torch.from_numpy(data.y[rows])
            )
            losses.append(result.loss)
    return float(np.mean(losses)) if losses else float("nan")


def _evaluate(raw: dict[str, Any], test: Dataset):  # type: ignore[no-untyped-def]
    shape = tuple(raw["input_shape"])
    return lambda weights: evaluate_weights(raw["model"], shape, raw["num_classes"], weights, test)


def train_centralized(
    raw: dict[str, Any], train: Dataset, test: Dataset, store: RunStore, run_id: str
) -> None:
    whole = _whole(raw)
    evaluate = _evaluate(raw, test)
    store.create_run(run_id, {**raw, "method": "centralized"}, int(raw["seed"]))
    store.set_run_status(run_id, "training")
    for number in range(1, int(raw["rounds"]) + 1):
        started = time.perf_counter()
        store.open_round(run_id, number, ["central"])
        loss = _epochs(whole, train, raw, int(raw["seed"]) + number)
        weights = segment_state(whole)
        evaluation = evaluate(weights)
        wall = time.perf_counter() - started
        store.record_results(
            run_id,
            number,
            [
                DeviceResult(
                    "central", len(train) * int(raw["local_epochs"]), loss, wall_seconds=wall
                )
            ],
        )
        store.commit_round(
            run_id,
            number,
            {"global": weights},
            metrics={"wall_seconds": wall},
            evaluation=evaluation,
        )
        log.info("round %d: %s", number, evaluation)
    store.set_run_status(run_id, "finished")


def whole_model_bytes(raw: dict[str, Any], profile: Any) -> int:
    """Estimated training memory of the whole model on one client."""
    return estimate_segment_memory(
        profile, 0, profile.num_blocks, int(raw["batch_size"]), raw["optimizer"]["name"]
    ).total


def train_fedavg(
    raw: dict[str, Any],
    parts: dict[str, Dataset],
    test: Dataset,
    store: RunStore,
    run_id: str,
) -> None:
    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    for index, (name, data) in enumerate(parts.items()):
        segment = _whole(raw)
        app = ClientApp()

        @app.train()
        def train(message: Message, _context: Context, segment=segment, data=data) -> Message:  # type: ignore[no-untyped-def]
            started = time.perf_counter()
            load_segment_state(segment, numpy_arrays(message))
            segment.reset_optimizer()
            number = round_of(message)
            loss = _epochs(segment, data, raw, int(raw["seed"]) + number)
            arrays = segment_state(segment)
            metrics = MetricRecord(
                {
                    "num-examples": len(data) * int(raw["local_epochs"]),
                    "loss": loss,
                    "bytes-sent": sum(a.nbytes for a in arrays.values()),
                    "wall-seconds": time.perf_counter() - started,
                }
            )
            return Message(
                RecordDict({"arrays": array_record(arrays), "metrics": metrics}), reply_to=message
            )

        FlowerNode(
            hub.connect(f"{name}-control", node_will(index + 1, name)), index + 1, app, name=name
        )
    grid.wait_for_nodes(len(parts), timeout=30)
    flower = logging.getLogger("flwr")
    level = flower.level
    flower.setLevel(logging.ERROR)  # Flower warns that federated evaluation is off
    strategy = build_strategy(
        "fedavg", fraction_evaluate=0.0, min_available_nodes=len(parts), min_train_nodes=len(parts)
    )
    flower.setLevel(level)
    store.create_run(run_id, {**raw, "method": "fedavg"}, int(raw["seed"]))
    initial = segment_state(_whole(raw))
    run_rounds(
        store,
        run_id,
        strategy,
        grid,
        initial,
        int(raw["rounds"]),
        list(parts),
        _evaluate(raw, test),
    )
