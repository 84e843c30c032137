"""Baselines for ``edgesplit simulate``, in the same harness and outputs as the split methods.

- ``fedavg``: every client trains the whole model on its own data each round; the configured
  strategy (``strategy:``, FedAvg by default, its ``fraction_train`` sampling included)
  aggregates the models; ``availability`` does not apply (every client stays online). Clients
  whose memory the whole model's training exceeds are flagged in the report (they train
  anyway: this is a simulation of what would not fit).
- ``centralized``: one "device" holding the pooled training data, end-to-end
  back-propagation, one "round" per ``local_epochs`` epochs (its optimizer state carries over).

Both are Flower client apps on the in-process transport, driven by the coordinator's round
engine (:func:`coordinator.federated.run_federated`): the same send, collect and commit path
as the split methods, so every round is committed to the run store the same way.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg

from coordinator.aggregation import configured_strategy
from coordinator.federated import run_federated
from coordinator.recorder import RoundObserver
from edge_client.agent import statistics_reply
from simulation.config import BASELINES, Profile, SimConfig
from split_models.config import ModelConfig, TrainingConfig
from split_models.data import Dataset, batch_slices, shuffle_rng
from split_models.errors import ConfigError
from split_models.evaluation import evaluate_weights
from split_models.isolated import profile_in_fresh_process
from split_models.memory import estimate_segment_memory
from split_models.profiler import ModelProfile
from split_models.randomness import RandomStream, stream_seed
from split_models.segment import Segment
from split_models.weights import load_segment_state, norm_keys, segment_state
from storage.base import RunStore
from wire.flower import (
    FlowerNode,
    TransportGrid,
    array_record,
    node_will,
    numpy_arrays,
    order_of,
    proximal_mu_of,
    round_of,
)
from wire.roles import node_id_for
from wire.transport import InProcessHub

__all__ = [
    "ignored_by_baseline",
    "model_profile",
    "run_baseline",
    "train_centralized",
    "train_fedavg",
    "use_profile_cache",
    "whole_model_bytes",
]

log = logging.getLogger(__name__)


def _whole(config: SimConfig) -> Segment:
    model = config.model
    built = model.build(seed=config.training.seed)
    return Segment.from_model(built, 0, built.num_blocks, optimizer=config.training.optimizer)


def _epochs(
    segment: Segment, data: Dataset, training: TrainingConfig, generator: np.random.Generator
) -> float:
    """``local_epochs`` passes, each in ``generator``'s order; the mean loss."""
    losses = []
    batch = training.batch_size
    for _ in range(training.local_epochs):
        for rows in batch_slices(generator.permutation(len(data)), batch):
            result = segment.train_step(
                torch.from_numpy(data.x[rows]), torch.from_numpy(data.y[rows])
            )
            losses.append(result.loss)
    return float(np.mean(losses)) if losses else float("nan")


def _evaluate(
    model: ModelConfig, test: Dataset
) -> Callable[[Mapping[str, np.ndarray]], dict[str, float]]:
    return lambda weights: evaluate_weights(model, weights, test)


def _client(
    config: SimConfig, data: Dataset, reset: bool, upload: bool, name: str = "central"
) -> ClientApp:
    """A client training the whole model on ``data`` each round; ``reset``: a fresh optimizer
    state each round; ``upload``: its weights count as bytes sent. ``name`` seeds its dropout
    masks with the run's seed and the round (:mod:`split_models.randomness`)."""
    segment, app, training = _whole(config), ClientApp(), config.training

    @app.train()
    def train(message: Message, _context: Context) -> Message:
        started = time.perf_counter()
        received = numpy_arrays(message)
        load_segment_state(segment, received)
        if reset:  # the centralized baseline keeps its optimizer state (one client)
            segment.reset_optimizer(proximal_mu_of(message))
        number, tried = round_of(message), order_of(message)
        segment.lr_scale = training.lr_scale(number)
        segment.random = RandomStream(stream_seed(training.seed, name, number, tried))
        loss = _epochs(segment, data, training, shuffle_rng(training.seed, number, tried))
        arrays = segment_state(segment)
        metrics = MetricRecord(
            {
                "num-examples": len(data) * training.local_epochs,
                "loss": loss,
                "wall-seconds": time.perf_counter() - started,
            }
        )
        if upload:  # the round's weights came down, its result goes up
            metrics["bytes-sent"] = sum(a.nbytes for a in arrays.values())
            metrics["bytes-received"] = sum(a.nbytes for a in received.values())
        content = RecordDict({"arrays": array_record(arrays), "metrics": metrics})
        return Message(content, reply_to=message)

    app.evaluate()(_statistics(config, data))
    return app


def _statistics(config: SimConfig, data: Dataset) -> Callable[[Message, Context], Message]:
    """A client's answer to ``norm: recalibrate``: the aggregate's BatchNorm statistics on
    its ``data`` (the coordinator asks for them with an evaluate message), as an edge's."""
    return lambda message, _context: statistics_reply(
        message, config.model, data, config.training.seed
    )


def _train(
    config: SimConfig,
    clients: dict[str, ClientApp],
    test: Dataset,
    store: RunStore,
    run_id: str,
    observer: RoundObserver | None = None,
) -> None:
    """``clients`` (name -> app) as Flower nodes; FedAvg rounds over them, committed. The run
    stores ``config`` (its ``method`` the baseline's), which ``parse_sim_config`` reads back;
    ``observer`` (a progress display) hears about every round."""
    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    nodes = {name: node_id_for(name) for name in clients}
    for name, app in clients.items():
        FlowerNode(
            hub.connect(f"{name}-control", node_will(nodes[name], name)),
            nodes[name],
            app,
            name=name,
        )
    grid.wait_for_nodes(len(nodes), timeout=30)
    strategy = _strategy(config)
    training = config.training
    store.create_run(run_id, config.to_dict(), training.seed)
    whole = _whole(config)
    initial = segment_state(whole)
    evaluate = _evaluate(config.model, test)
    local = frozenset(norm_keys(whole)) if training.norm == "local" else frozenset()
    run_federated(
        store,
        run_id,
        strategy,
        grid,
        initial,
        training.rounds,
        nodes,
        evaluate,
        seed=training.seed,
        local_keys=local,
        recalibrate=training.norm == "recalibrate" and config.method == "fedavg",
        observer=observer,
    )


def _strategy(config: SimConfig) -> FedAvg:
    """The configured strategy with its options (``fraction_train`` samples clients as in the
    split methods); the centralized baseline's one client is averaged by FedAvg."""
    if config.method == "centralized":
        return configured_strategy("fedavg", {})[0]
    return configured_strategy(config.aggregation.name, config.aggregation.options)[0]


def train_centralized(
    config: SimConfig,
    train: Dataset,
    test: Dataset,
    store: RunStore,
    run_id: str,
    observer: RoundObserver | None = None,
) -> None:
    """The pooled ``train`` data on one device, ``central``, end to end."""
    config = replace(config, method="centralized")
    clients = {"central": _client(config, train, reset=False, upload=False)}
    _train(config, clients, test, store, run_id, observer)


def whole_model_bytes(training: TrainingConfig, profile: ModelProfile, anchor: bool = False) -> int:
    """Estimated training memory of the whole model on one client (``anchor``: with
    FedProx's copy of the round's weights)."""
    return estimate_segment_memory(
        profile, 0, profile.num_blocks, training.batch_size, training.optimizer.name, None, anchor
    ).total


def train_fedavg(
    config: SimConfig,
    parts: dict[str, Dataset],
    test: Dataset,
    store: RunStore,
    run_id: str,
    observer: RoundObserver | None = None,
) -> None:
    """Every client of ``parts`` trains the whole model; FedAvg averages them each round."""
    config = replace(config, method="fedavg")
    clients = {name: _client(config, data, True, True, name) for name, data in parts.items()}
    _train(config, clients, test, store, run_id, observer)


@dataclass(frozen=True)
class _Whole:
    """The whole model's size: training memory, forward FLOPs per sample, bytes, blocks."""

    need: int = 0
    flops: float = 0.0
    model_bytes: int = 0
    num_blocks: int = 0


_PROFILE_CACHE: list[Path | None] = [None]


def use_profile_cache(folder: Path | None) -> None:
    """Keep model profiles in ``folder`` across processes (the CLI's ``--profile-cache``;
    :func:`~split_models.isolated.profile_in_fresh_process`)."""
    _PROFILE_CACHE[0] = folder


@functools.lru_cache(maxsize=16)
def _profile_of(model: ModelConfig, local_loss: str, batch: int) -> ModelProfile:
    return profile_in_fresh_process(model, (local_loss,), batch, cache=_PROFILE_CACHE[0])


def model_profile(model: ModelConfig, training: TrainingConfig) -> ModelProfile:
    """The model's profile, measured in a fresh process once per model, local loss and batch
    in this process (a host running many simulations, a benchmark's or a test's, profiles
    each model once)."""
    return _profile_of(model, training.local_loss, training.batch_size)


def _whole_profile(config: SimConfig) -> _Whole:
    model, training = config.model, config.training
    profile = model_profile(model, training)
    return _Whole(
        whole_model_bytes(training, profile, config.aggregation.anchors),
        sum(b.flops for b in profile.blocks),
        sum(b.param_bytes + b.buffer_bytes for b in profile.blocks),
        profile.num_blocks,
    )


def _client_rows(
    training: TrainingConfig,
    data: dict[str, Dataset],
    profiles: Mapping[str, Profile],
    whole: _Whole,
) -> list[dict[str, Any]]:
    rounds, epochs = training.rounds, training.local_epochs
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
    training: TrainingConfig,
    data: dict[str, Dataset],
    profiles: Mapping[str, Profile],
    whole: _Whole,
) -> float:
    """A FedAvg round's simulated time: the slowest client's max(compute, upload)."""
    epochs = training.local_epochs
    return max(
        max(3 * len(data[n]) * epochs * whole.flops / p.flops, whole.model_bytes / p.uplink)
        for n, p in profiles.items()
    )


def run_baseline(
    config: SimConfig,
    data: tuple[Dataset, Dataset],
    parts: Sequence[np.ndarray],
    store: RunStore,
    run_id: str,
    observer: RoundObserver | None = None,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """Train ``config.method`` on ``data`` (train, test) into ``store``: ``fedavg`` over the
    fleet's clients, each on its part (rows of train, in client order), ``centralized`` on all
    of it pooled; the report's round rows, client rows and plan text."""
    train, test = data
    whole, clients, simulated = _Whole(), [], None
    if config.method == "fedavg":  # centralized has no clients to size (and is not timed so)
        profiles = config.fleet.client_profiles()
        whole = _whole_profile(config)
        subsets = {name: train.subset(rows) for name, rows in zip(profiles, parts, strict=True)}
        train_fedavg(config, subsets, test, store, run_id, observer)
        clients = _client_rows(config.training, subsets, profiles, whole)
        simulated = _simulated(config.training, subsets, profiles, whole)
    elif config.method == "centralized":
        train_centralized(config, train, test, store, run_id, observer)
    else:
        raise ConfigError(f"method: {config.method!r} is not a baseline; use one of {BASELINES}")
    rows = [
        {
            "round": record.number,
            "accuracy": record.evaluation.get("accuracy"),
            "loss": record.evaluation.get("loss"),
            "participants": trained,  # the clients the strategy sampled that trained
            "bytes_up": whole.model_bytes * trained,
            "bytes_down": whole.model_bytes * trained,
            "wall_seconds": record.metrics.get("wall_seconds"),
            "simulated_seconds": simulated,
        }
        for record in store.list_rounds(run_id)
        for trained in [int(record.metrics.get("participants_ok", len(clients)))]
    ]
    return rows, clients, _plan_text(config.method, clients, whole)


def _plan_text(method: str, clients: list[dict[str, Any]], whole: _Whole) -> str:
    if method == "centralized":
        return "centralized: one process, the whole model, pooled data"
    unfit = [c["name"] for c in clients if not c["fits"]]
    return (
        f"fedavg: the whole model ({whole.num_blocks} blocks, estimated "
        f"{whole.need} bytes to train) on every client"
        + (f"; it does not fit {', '.join(unfit)}" if unfit else "")
    )


def ignored_by_baseline(config: SimConfig) -> list[str]:
    """The keys set away from their defaults that a baseline has no use for (the cut, what
    crosses it; for centralized, one client, also how the clients are split and averaged)."""
    default, fleet, training = SimConfig(), config.fleet, config.training
    keys = {
        "cuts": fleet.cuts != default.fleet.cuts,
        "compression": training.compression != default.training.compression,
        "local_loss": training.local_loss != default.training.local_loss,
        "batched": fleet.batched,
        "group_clients": fleet.group_clients,
    }
    if config.method == "centralized":
        keys["partition"] = fleet.partition != default.fleet.partition
        keys["strategy"] = config.aggregation != default.aggregation
    return [key for key, set_ in keys.items() if set_]
