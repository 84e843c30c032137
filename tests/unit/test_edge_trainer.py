"""The edge's training loop keeps at most one batch in the transport's hands."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from edge_client.trainer import EdgeTrainer, EdgeTrainerConfig
from split_models.cpu import process_cpu_share
from split_models.data import Dataset
from split_models.segment import OptimizerConfig, Segment, StepResult
from split_models.zoo import build_model
from wire.channel import Channel
from wire.codec import Envelope
from wire.flow import CreditGate
from wire.transport import InProcessHub, InProcessTransport

pytestmark = pytest.mark.unit


class _SlowAcks(InProcessTransport):
    """A transport whose broker acknowledges only when asked to flush (a slow uplink)."""

    def __init__(self, hub: InProcessHub) -> None:
        super().__init__(hub, "pi-01-stream")
        self.unacknowledged = 0
        self.held_at_publish: list[int] = []

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        if "/act/" in topic:
            self.held_at_publish.append(self.unacknowledged)
        self.unacknowledged += 1
        super().publish(topic, payload, retain)

    def flush(self, timeout: float = 30.0) -> None:
        self.unacknowledged = 0


def _granted(transport: InProcessTransport, examples: int) -> tuple[Channel, CreditGate, Dataset]:
    """A channel over ``transport`` with 100 credits granted, and ``examples`` random digits."""
    channel = Channel(transport, "pi-01")
    gate = CreditGate(channel, "run", "pi-01")
    gate.on_credit(Envelope("credit", "run", "gpu-a", 0, round=1, meta={"credits": 100}))
    rng = np.random.default_rng(0)
    data = Dataset(
        rng.normal(size=(examples, 1, 8, 8)).astype(np.float32),
        rng.integers(0, 10, size=examples).astype(np.int64),
        10,
    )
    return channel, gate, data


def test_a_batch_is_published_only_after_the_previous_one_was_acknowledged() -> None:
    transport = _SlowAcks(InProcessHub())
    channel, gate, data = _granted(transport, 40)
    model = build_model("mlp", (1, 8, 8), 10, seed=0)
    segment = Segment.from_model(model, 0, 1, "linear", OptimizerConfig("sgd"))
    config = EdgeTrainerConfig("run", "pi-01", "seg-0", batch_size=8, encoding="fp16")
    report = EdgeTrainer(channel, gate, segment, data, config).train_round(1)
    assert report.examples == 40
    assert transport.held_at_publish == [0] * 5, transport.held_at_publish


def test_the_round_reports_its_timed_steps_without_the_first() -> None:
    channel, gate, data = _granted(InProcessTransport(InProcessHub(), "pi-01-stream"), 36)
    segment = Segment.from_model(build_model("mlp", (1, 8, 8), 10, seed=0), 0, 1, "linear")
    config = EdgeTrainerConfig("run", "pi-01", "seg-0", batch_size=8)

    compute = EdgeTrainer(channel, gate, segment, data, config).train_round(1).compute

    # five batches (8, 8, 8, 8, 4): the first is left out of the timing
    assert compute["compute-cuts"] == [1]
    assert compute["compute-steps"] == 4
    assert compute["compute-examples"] == [28]
    assert 0 < compute["compute-seconds"] < 60  # type: ignore[operator]
    # the thread's CPU seconds of the same steps (never more than their wall time), and the
    # share of a core this process's quota allows
    assert 0 < compute["compute-cpu-seconds"] <= compute["compute-seconds"] + 1e-3  # type: ignore[operator]
    assert compute["cpu-share"] == process_cpu_share(torch.get_num_threads())


def _trained_order(attempt: int) -> list[float]:
    """The first pixel of every example a fresh trainer trains in try ``attempt`` of round 1
    (seed 0), in the order it trained them."""
    channel, gate, data = _granted(InProcessTransport(InProcessHub(), "pi-01-stream"), 40)
    gate.on_credit(
        Envelope("credit", "run", "gpu-a", 0, round=1, meta={"credits": 100, "attempt": attempt})
    )
    segment = Segment.from_model(build_model("mlp", (1, 8, 8), 10, seed=0), 0, 1, "linear")
    config = EdgeTrainerConfig("run", "pi-01", "seg-0", batch_size=8)
    seen: list[float] = []

    def step(inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        seen.extend(inputs[:, 0, 0, 0].tolist())
        return segment.train_step(inputs, labels)

    EdgeTrainer(channel, gate, segment, data, config).train_round(1, step=step, attempt=attempt)
    return seen


def test_a_retried_round_trains_the_same_examples_in_another_order() -> None:
    first, again, retry = _trained_order(1), _trained_order(1), _trained_order(2)
    assert first == again, "the same try of the same round trains in the same order"
    assert retry != first, "a retry that repeated the failed try's order step for step"
    assert sorted(retry) == sorted(first) and len(first) == 40
    assert _trained_order(3) not in (first, retry)
