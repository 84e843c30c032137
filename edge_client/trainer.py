"""The edge's training loop: train the front segment with its local loss and stream the cut.

Each batch: wait for a credit from the GPU servers, take one optimizer step on the local loss,
send the detached activations and labels. No gradient ever comes back (local-loss mode).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from split_models.data import Dataset
from split_models.segment import Segment
from wire import topics
from wire.channel import Channel
from wire.flow import CreditGate

__all__ = ["EdgeRoundReport", "EdgeTrainer", "EdgeTrainerConfig"]


@dataclass(frozen=True)
class EdgeTrainerConfig:
    run: str
    device: str
    segment: str  # name of the server-side stream the activations feed
    batch_size: int = 32
    local_epochs: int = 1
    encoding: str = "fp32"
    credit_timeout: float = 60.0


@dataclass(frozen=True)
class EdgeRoundReport:
    examples: int
    batches: int
    mean_loss: float
    bytes_sent: int
    credit_wait_seconds: float
    wall_seconds: float


class EdgeTrainer:
    """Trains ``segment`` (blocks ``[0, cut)`` and its head) on ``data`` and streams the cut."""

    def __init__(
        self,
        channel: Channel,
        gate: CreditGate,
        segment: Segment,
        data: Dataset,
        config: EdgeTrainerConfig,
    ) -> None:
        if segment.start != 0 or segment.is_last:
            raise ValueError("an edge trains a prefix [0, cut) with a local-loss head")
        self.channel, self.gate, self.segment = channel, gate, segment
        self.data, self.config = data, config
        self.topic = topics.activations(config.run, config.segment, config.device)

    def train_round(self, round_number: int, seed: int = 0) -> EdgeRoundReport:
        """``local_epochs`` passes over the local data; raises TimeoutError without credits."""
        started, sent_before = time.perf_counter(), self.channel.stats.bytes_sent
        waited_before = self.gate.waited_seconds
        generator = np.random.default_rng(seed + round_number)
        losses: list[float] = []
        examples = 0
        self.gate.start_round(round_number)
        batches = [
            order[begin : begin + self.config.batch_size]
            for order in (
                generator.permutation(len(self.data)) for _ in range(self.config.local_epochs)
            )
            for begin in range(0, len(order), self.config.batch_size)
        ]
        for number, batch in enumerate(batches):
            if not self.gate.acquire(self.config.credit_timeout):
                raise TimeoutError(
                    f"no credit from the GPU servers within {self.config.credit_timeout:.0f} s"
                )
            inputs = torch.from_numpy(self.data.x[batch])
            labels = torch.from_numpy(self.data.y[batch])
            result = self.segment.train_step(inputs, labels)
            self.channel.send(
                self.topic,
                "activations",
                self.config.run,
                round=round_number,
                tensors={"x": result.output.numpy(), "y": labels.numpy()},
                meta={"cut": self.segment.end, "last": number == len(batches) - 1},
                encoding=self.config.encoding,
            )
            losses.append(result.loss)
            examples += len(batch)
        return EdgeRoundReport(
            examples=examples,
            batches=len(losses),
            mean_loss=float(np.mean(losses)) if losses else float("nan"),
            bytes_sent=self.channel.stats.bytes_sent - sent_before,
            credit_wait_seconds=self.gate.waited_seconds - waited_before,
            wall_seconds=time.perf_counter() - started,
        )
