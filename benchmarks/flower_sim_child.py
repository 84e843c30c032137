"""One side of ``benchmarks/flower_sim.py`` in its own process tree: the FedAvg job in Flower's
simulation (``flower``) or in ``edgesplit simulate --method fedavg`` (``edgesplit``).

    python benchmarks/flower_sim_child.py flower|edgesplit CLIENTS ROUNDS WORK RESULT.json

Writes ``{"training": s, "accuracy": a}`` to RESULT.json.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

from split_models.runtime import configure_process

configure_process()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _report import shared_data  # noqa: E402

# benchmarks/storage.py would shadow the `storage` package the simulation imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from simulation.config import SimConfig, parse_sim_config  # noqa: E402
from split_models.data import Dataset, from_arrays, partition  # noqa: E402

SHARED = shared_data()


def sim_config(work: Path, clients: int, rounds: int) -> SimConfig:
    """The job, as ``edgesplit simulate`` runs it; the Flower side reads its model and
    training sections."""
    return parse_sim_config(
        {
            "model": "cnn",
            "input_shape": [1, 28, 28],
            "num_classes": 10,
            "data": f"npz:{work / 'train.npz'}",
            "test_data": f"npz:{work / 'test.npz'}",
            "clients": clients,
            "partition": {"kind": "iid"},
            "devices": [{"profile": "any", "share": 1.0, "memory": "1GiB", "flops": 5e10}],
            "rounds": rounds,
            "local_epochs": 1,
            "batch_size": 32,
            "optimizer": {"name": "adam", "lr": 0.001},
            "method": "fedavg",
            "seed": 0,
            "measure_memory": False,
        }
    )


def _data() -> tuple[Dataset, Dataset]:  # uncached: Ray ships the client app by value
    with np.load(SHARED) as archive:
        x, y = archive["x"], archive["y"]
    return from_arrays(x[:6000], y[:6000]), from_arrays(x[-2000:], y[-2000:])


def run_edgesplit(work: Path, clients: int, rounds: int) -> dict[str, float]:
    from simulation.simulator import simulate

    with np.load(SHARED) as archive:
        x, y = archive["x"], archive["y"]
    np.savez(work / "train.npz", x=x[:6000], y=y[:6000])
    np.savez(work / "test.npz", x=x[-2000:], y=y[-2000:])
    summary = simulate(sim_config(work, clients, rounds), work / f"edgesplit-{clients}")
    return {
        "training": summary["training_wall_seconds"],
        "accuracy": summary["final_accuracy"],
    }


def _client_app(config: SimConfig) -> Any:
    from flwr.app import Context, Message, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp

    from split_models.segment import Segment
    from split_models.weights import load_segment_state, segment_state
    from wire.flower import array_record, numpy_arrays

    app, model, training = ClientApp(), config.model, config.training

    def whole() -> Segment:  # built per message: Ray ships the app by value
        built = model.build(seed=training.seed)
        return Segment.from_model(built, 0, built.num_blocks, optimizer=training.optimizer)

    @app.train()
    def train(message: Message, context: Context) -> Message:
        configure_process()
        train, _ = _data()
        rows = partition(train.y, config.fleet.clients, "iid", seed=training.seed)
        rows = rows[int(context.node_config["partition-id"])]
        segment = whole()
        load_segment_state(segment, numpy_arrays(message))
        segment.reset_optimizer()
        order = np.random.default_rng(training.seed).permutation(rows)
        for begin in range(0, len(order), training.batch_size):
            batch = order[begin : begin + training.batch_size]
            segment.train_step(torch.from_numpy(train.x[batch]), torch.from_numpy(train.y[batch]))
        reply = RecordDict(
            {
                "arrays": array_record(segment_state(segment)),
                "metrics": MetricRecord({"num-examples": len(rows)}),
            }
        )
        return Message(reply, reply_to=message)

    return app


def _server_app(config: SimConfig, clients: int, seen: dict[str, list[Any]]) -> Any:
    """Flower's FedAvg over ``clients`` nodes from the model's initial weights, evaluating on
    the test set before training and after each round; ``seen`` gets each evaluation's
    (start, end) stamps and accuracy and each round's count of clients that trained."""
    from flwr.app import ArrayRecord, MetricRecord
    from flwr.serverapp import Grid, ServerApp
    from flwr.serverapp.strategy import FedAvg

    from split_models.evaluation import evaluate_weights
    from split_models.segment import Segment
    from split_models.weights import segment_state
    from wire.flower import array_record

    built = config.model.build(seed=config.training.seed)
    initial = segment_state(Segment.from_model(built, 0, built.num_blocks))

    def evaluate(_round: int, arrays: ArrayRecord) -> MetricRecord:
        began = time.perf_counter()
        weights = {name: value.numpy() for name, value in arrays.items()}
        found = evaluate_weights(config.model, weights, _data()[1])
        seen["accuracy"].append(found["accuracy"])
        seen["stamps"].append((began, time.perf_counter()))
        return MetricRecord(found)

    def count(records: list[Any], _key: str) -> MetricRecord:
        seen["replies"].append(len(records))  # the clients that trained (errors left out)
        return MetricRecord({"replies": len(records)})

    server = ServerApp()

    @server.main()
    def main(grid: Grid, _context: Any) -> None:
        FedAvg(
            fraction_evaluate=0.0,
            min_train_nodes=clients,
            min_available_nodes=clients,
            train_metrics_aggr_fn=count,
        ).start(
            grid=grid,
            initial_arrays=array_record(initial),
            num_rounds=config.training.rounds,
            evaluate_fn=evaluate,
        )

    return server


def run_flower(clients: int, rounds: int) -> dict[str, float]:
    from flwr.simulation import run_simulation

    config = sim_config(Path("."), clients, rounds)
    seen: dict[str, list[Any]] = {"stamps": [], "accuracy": [], "replies": []}
    run_simulation(
        server_app=_server_app(config, clients, seen),
        client_app=_client_app(config),
        num_supernodes=clients,
        backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0}},
    )
    stamps, replies = seen["stamps"], seen["replies"]
    if replies != [clients] * rounds:
        raise SystemExit(f"Flower's clients that trained, per round: {replies}, not {clients}")
    if len(stamps) != rounds + 1:
        raise SystemExit(f"Flower's simulation evaluated {len(stamps)} times, not {rounds + 1}")
    training = sum(stamps[r][0] - stamps[r - 1][1] for r in range(1, len(stamps)))
    return {"training": training, "accuracy": seen["accuracy"][-1]}


def main() -> None:
    side, clients, rounds, work, result = sys.argv[1:6]
    if side == "flower":
        found = run_flower(int(clients), int(rounds))
    else:
        found = run_edgesplit(Path(work), int(clients), int(rounds))
    Path(result).write_text(json.dumps(found))


if __name__ == "__main__":
    main()
