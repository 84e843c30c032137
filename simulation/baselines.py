"""Baselines for ``edgesplit simulate``, in the same harness and outputs as the split methods.

- ``fedavg``: every client trains the whole model on its own data each round; a Flower FedAvg
  strategy averages the models. Clients whose memory the whole model's training exceeds are
  flagged in the report (they train anyway: this is a simulation of what would not fit).
- ``centralized``: one "device" holding the pooled training data, end-to-end
  back-propagation, one "round" per ``local_epochs`` epochs (its optimizer state carries over).

Both are Flower client apps on the in-process transport, driven by the coordinator's round
engine (:func:`coordinator.federated.run_federated`): the same send, collect and commit path
as the split methods, so every round is committed to the run store the same way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from coordinator.aggregation import build_strategy
from coordinator.federated import run_federated
from split_models.data import Dataset
from split_models.evaluation import evaluate_weights
from split_models.isolated import profile_in_fresh_process
from split_models.memory import estimate_segment_memory
from split_models.segment import OptimizerConfig, Segment
from split_models.weights import load_segment_state, segment_state
from split_models.zoo import build_model
from storage.base import RunStore
from wire.flower import FlowerNode, TransportGrid, array_record, node_will, numpy_arrays, round_of
from wire.transport import InProcessHub

__all__ = [
    "ClientProfile",
    "run_baseline",
    "train_centralized",
    "train_fedavg",
    "whole_model_bytes",
]

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


def _evaluate(
    raw: dict[str, Any], test: Dataset
) -> Callable[[Mapping[str, np.ndarray]], dict[str, float]]:
    shape = tuple(raw["input_shape"])
    return lambda weights: evaluate_weights(raw["model"], shape, raw["num_classes"], weights, test)


def _client(raw: dict[str, Any], data: Dataset, reset: bool, upload: bool) -> ClientApp:
    """A client training the whole model on ``data`` each round; ``reset``: a fresh optimizer
    state each round; ``upload``: its weights count as bytes sent."""
    segment, app = _whole(raw), ClientApp()

    @app.train()
    def train(message: Message, _context: Context) -> Message:
        started = time.perf_counter()
        load_segment_state(segment, numpy_arrays(message))
        if reset:
            segment.reset_optimizer()
        loss = _epochs(segment, data, raw, int(raw["seed"]) + round_of(message))
        arrays = segment_state(segment)
        metrics = MetricRecord(
            {
                "num-examples": len(data) * int(raw["local_epochs"]),
                "loss": loss,
                "wall-seconds": time.perf_counter() - started,
            }
        )
        if upload:
            metrics["bytes-sent"] = sum(a.nbytes for a in arrays.values())
        content = RecordDict({"arrays": array_record(arrays), "metrics": metrics})
        return Message(content, reply_to=message)

    return app


def _train(
    raw: dict[str, Any],
    clients: dict[str, ClientApp],
    test: Dataset,
    store: RunStore,
    run_id: str,
    method: str,
) -> None:
    """``clients`` (name -> app) as Flower nodes; FedAvg rounds over them, committed."""
    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    nodes = {name: index + 1 for index, name in enumerate(clients)}
    for name, app in clients.items():
        FlowerNode(
            hub.connect(f"{name}-control", node_will(nodes[name], name)),
            nodes[name],
            app,
            name=name,
        )
    grid.wait_for_nodes(len(nodes), timeout=30)
    flower = logging.getLogger("flwr")
    level = flower.level
    flower.setLevel(logging.ERROR)  # Flower warns that federated evaluation is off
    try:
        strategy = build_strategy(
            "fedavg",
            fraction_evaluate=0.0,
            min_available_nodes=len(nodes),
            min_train_nodes=len(nodes),
        )
    finally:
        flower.setLevel(level)
    store.create_run(run_id, {**raw, "method": method}, int(raw["seed"]))
    initial = segment_state(_whole(raw))
    rounds, evaluate = int(raw["rounds"]), _evaluate(raw, test)
    run_federated(
        store, run_id, strategy, grid, initial, rounds, nodes, evaluate, seed=int(raw["seed"])
    )


def train_centralized(
    raw: dict[str, Any], train: Dataset, test: Dataset, store: RunStore, run_id: str
) -> None:
    """The pooled ``train`` data on one device, ``central``, end to end."""
    clients = {"central": _client(raw, train, reset=False, upload=False)}
    _train(raw, clients, test, store, run_id, "centralized")


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
    """Every client of ``parts`` trains the whole model; FedAvg averages them each round."""
    clients = {name: _client(raw, data, reset=True, upload=True) for name, data in parts.items()}
    _train(raw, clients, test, store, run_id, "fedavg")


class ClientProfile(Protocol):
    """What the report needs of a simulated client's device profile."""

    @property
    def name(self) -> str: ...

    @property
    def memory(self) -> int: ...

    @property
    def flops(self) -> float: ...

    @property
    def uplink(self) -> float: ...


@dataclass(frozen=True)
class _Whole:
    """The whole model's size: training memory, forward FLOPs per sample, bytes, blocks."""

    need: int = 0
    flops: float = 0.0
    model_bytes: int = 0
    num_blocks: int = 0


def _whole_profile(raw: dict[str, Any]) -> _Whole:
    profile = profile_in_fresh_process(
        raw["model"],
        raw["input_shape"],
        raw["num_classes"],
        (raw["local_loss"],),
        raw["batch_size"],
    )
    return _Whole(
        whole_model_bytes(raw, profile),
        sum(b.flops for b in profile.blocks),
        sum(b.param_bytes + b.buffer_bytes for b in profile.blocks),
        profile.num_blocks,
    )


def _client_rows(
    raw: dict[str, Any],
    data: dict[str, Dataset],
    profiles: Mapping[str, ClientProfile],
    whole: _Whole,
) -> list[dict[str, Any]]:
    rounds, epochs = int(raw["rounds"]), int(raw["local_epochs"])
    return [
        {
            "name": name,
            "profile": profile.name,
            "blocks": [0, whole.num_blocks],
            "budget_bytes": profile.memory,
            "estimated_peak_bytes": whole.need,
            "fits": whole.need <= profile.memory,
            "measured_peak_bytes": None,
            "bytes_up": whole.model_bytes * rounds,
            "bytes_down": whole.model_bytes * rounds,
            "cut_bytes_up": 0,
            "cut_bytes_down": 0,
            "examples": len(data[name]) * epochs * rounds,
            "rounds_trained": rounds,
        }
        for name, profile in profiles.items()
    ]


def _simulated(
    raw: dict[str, Any],
    data: dict[str, Dataset],
    profiles: Mapping[str, ClientProfile],
    whole: _Whole,
) -> float:
    """A FedAvg round's simulated time: the slowest client's max(compute, upload)."""
    epochs = int(raw["local_epochs"])
    return max(
        max(3 * len(data[n]) * epochs * whole.flops / p.flops, whole.model_bytes / p.uplink)
        for n, p in profiles.items()
    )


def run_baseline(
    method: str,
    raw: dict[str, Any],
    data: tuple[Dataset, Dataset],
    parts: dict[str, np.ndarray],
    profiles: Mapping[str, ClientProfile],
    store: RunStore,
    run_id: str,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """Train ``method`` on ``data`` (train, test): ``fedavg`` over the clients' ``parts``
    (name -> rows of train), ``centralized`` on all of it pooled, into ``store``; the
    report's round rows, client rows and plan text."""
    train, test = data
    whole, clients, simulated = _Whole(), [], None
    if method == "fedavg":  # centralized has no clients to size (and is not timed so)
        whole = _whole_profile(raw)
        subsets = {name: train.subset(rows) for name, rows in parts.items()}
        train_fedavg(raw, subsets, test, store, run_id)
        clients = _client_rows(raw, subsets, profiles, whole)
        simulated = _simulated(raw, subsets, profiles, whole)
    else:
        train_centralized(raw, train, test, store, run_id)
    rows = [
        {
            "round": record.number,
            "accuracy": record.evaluation.get("accuracy"),
            "loss": record.evaluation.get("loss"),
            "participants": len(clients),
            "bytes_up": whole.model_bytes * len(clients),
            "bytes_down": whole.model_bytes * len(clients),
            "wall_seconds": record.metrics.get("wall_seconds"),
            "simulated_seconds": simulated,
        }
        for record in store.list_rounds(run_id)
    ]
    unfit = [c["name"] for c in clients if not c["fits"]]
    plan = (
        "centralized: one process, the whole model, pooled data"
        if method == "centralized"
        else f"fedavg: the whole model ({whole.num_blocks} blocks, estimated "
        f"{whole.need} bytes to train) on every client"
        + (f"; it does not fit {', '.join(unfit)}" if unfit else "")
    )
    return rows, clients, plan
