"""Decoupled split training on real data: two edges with different cuts stream to one GPU
server, over the in-process transport and over a real mosquitto."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from edge_client import EdgeRoundReport, EdgeTrainer, EdgeTrainerConfig
from gpu_server import BackTrainer
from split_models import OptimizerConfig, Segment, build_model, load_dataset, partition
from tests.integration.mqtt_clients import mqtt_clients
from wire import topics
from wire.broker import Broker
from wire.channel import Channel
from wire.codec import Envelope, encode
from wire.flow import CreditGate
from wire.transport import InProcessHub, Transport

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny_mnist.npz"
CUTS = {"pi-01": 1, "pi-02": 2}
ROUNDS = 3


def _fleet(
    connect: Callable[[str], Transport], run: str
) -> tuple[BackTrainer, dict[str, EdgeTrainer], int]:
    """The GPU server, an edge trainer per cut, and how many samples they hold together."""
    data = load_dataset(f"npz:{FIXTURE}")
    parts = partition(data.y, len(CUTS), "iid", seed=0)
    optimizer = OptimizerConfig("sgd-momentum", lr=0.01)
    back = BackTrainer(
        Channel(connect("gpu-a"), "gpu-a"),
        build_model("cnn", (1, 28, 28), 10, seed=0),
        start=min(CUTS.values()),
        run=run,
        segment="seg-0",
        optimizer=optimizer,
        window=2,
    )
    trainers = {}
    for (device, cut), indices in zip(CUTS.items(), parts, strict=True):
        channel = Channel(connect(device), device)
        model = build_model("cnn", (1, 28, 28), 10, seed=0)
        trainers[device] = EdgeTrainer(
            channel,
            CreditGate(channel, run, device),
            Segment.from_model(model, 0, cut, "linear", optimizer),
            data.subset(indices),
            EdgeTrainerConfig(run, device, "seg-0", batch_size=16),
        )
    return back, trainers, len(data)


def _rounds(
    back: BackTrainer, trainers: dict[str, EdgeTrainer]
) -> tuple[dict[str, list[EdgeRoundReport]], list[int]]:
    """What the coordinator does each round; every edge's reports and the server's examples."""
    reports: dict[str, list[EdgeRoundReport]] = {d: [] for d in CUTS}
    round_examples = []
    for round_number in range(1, ROUNDS + 1):
        back.begin_round(round_number, CUTS)
        threads = [
            threading.Thread(
                target=lambda d=d, r=round_number: reports[d].append(trainers[d].train_round(r))
            )
            for d in CUTS
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        examples, _ = back.wait_round(CUTS, timeout=30)
        round_examples.append(examples)
    return reports, round_examples


def _send_rogue_batch(connect: Callable[[str], Transport], trainer: EdgeTrainer, run: str) -> None:
    """A batch of the wrong shape for its cut, on ``trainer``'s stream, in the last round."""
    connect("rogue").publish(
        trainer.topic,
        encode(
            Envelope(
                "activations",
                run,
                "pi-01",
                0,
                ROUNDS,
                {"epoch": "0dd", "cut": 1},
                {"x": np.zeros((4, 3), np.float32), "y": np.zeros(4, np.int64)},
            )
        ),
    )


def _wait(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)


def train_split(connect: Callable[[str], Transport]) -> None:
    run = f"run-{uuid.uuid4().hex[:6]}"
    published: list[str] = []
    connect("spy").subscribe("edgesplit/v1/#", lambda topic, _p: published.append(topic))
    back, trainers, samples = _fleet(connect, run)
    time.sleep(0.3)
    reports, round_examples = _rounds(back, trainers)
    sent = sum(r.examples for rs in reports.values() for r in rs)

    assert all(len(rs) == ROUNDS for rs in reports.values())
    assert back.stats.examples == sent == ROUNDS * samples, "every batch trained once"
    assert round_examples == [samples] * ROUNDS, "each round waits for every last batch"
    for device, rs in reports.items():
        assert back.stats.per_device[device] == sum(r.examples for r in rs)
        assert rs[-1].mean_loss < rs[0].mean_loss, f"{device}'s local loss falls"
    losses = back.stats.losses
    assert np.mean(losses[-8:]) < np.mean(losses[:8]), "the server's task loss falls"
    assert not [t for t in published if "/grad/" in t], "no gradient crosses back"

    # A malformed batch (wrong shape for its cut) is rejected and its credit returned.
    gate = trainers["pi-01"].gate
    # every credit of the last round is back first (the window), so one more is the rogue's
    _wait(lambda: gate.available >= back.granter.window)
    before = gate.available
    assert before == back.granter.window
    _send_rogue_batch(connect, trainers["pi-01"], run)
    _wait(lambda: bool(back.stats.rejected))
    assert back.stats.rejected["shape"] == 1
    _wait(lambda: gate.available != before)
    assert gate.available == before + 1


def test_split_training_in_process() -> None:
    hub = InProcessHub()
    train_split(lambda name: hub.connect(name))


def test_split_training_over_mqtt(broker: Broker) -> None:
    with mqtt_clients(broker) as connect:
        train_split(connect)


def _closed_trainer_gets_nothing(connect: Callable[[str], Transport]) -> None:
    """A GPU server re-planned within a run replaces its trainer; the old one must leave the
    shared activation stream, or the broker keeps handing it a share of the batches."""
    run = f"run-{uuid.uuid4().hex[:6]}"
    old, new = (
        BackTrainer(
            Channel(connect(name), "gpu-a"),
            build_model("cnn", (1, 28, 28), 10, seed=0),
            start=1,
            run=run,
            segment="seg-0",
        )
        for name in ("gpu-a-old", "gpu-a-new")
    )
    old.close()
    new.begin_round(1, ["pi-01"])
    edge = Channel(connect("pi-01"), "pi-01")
    time.sleep(0.3)
    rng = np.random.default_rng(0)
    for _ in range(6):
        edge.send(
            topics.activations(run, "seg-0", "pi-01"),
            "activations",
            run,
            round=1,
            tensors={
                "x": rng.normal(size=(4, 32, 28, 28)).astype(np.float32),
                "y": rng.integers(0, 10, size=4),
            },
            meta={"cut": 1},
        )
    deadline = time.monotonic() + 30
    while new.stats.batches < 6 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert (old.stats.batches, new.stats.batches) == (0, 6)


def test_a_replaced_back_trainer_leaves_the_stream_in_process() -> None:
    hub = InProcessHub()
    _closed_trainer_gets_nothing(lambda name: hub.connect(name))


def test_a_replaced_back_trainer_leaves_the_stream_over_mqtt(broker: Broker) -> None:
    with mqtt_clients(broker) as connect:
        _closed_trainer_gets_nothing(connect)
