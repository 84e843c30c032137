"""The GPU server's training loop: train the back blocks on every edge's activation stream.

The server holds blocks ``[start, N)``; an activation batch cut after block ``s - 1`` (``s >=
start``) enters at block ``s`` and trains blocks ``[s, N)`` with the task loss. Each processed
batch returns a credit to its edge. Batches are validated against the shape the declared cut
must have; a bad one is counted and dropped, and its credit still returned so the edge does not
stall.
"""

from __future__ import annotations

import collections
import logging
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from split_models.segment import OptimizerConfig
from split_models.zoo import SplittableModel
from wire import topics
from wire.channel import Channel
from wire.codec import Envelope, TensorSpec
from wire.errors import WireError
from wire.flow import CreditGranter

__all__ = ["BackStats", "BackTrainer"]

log = logging.getLogger(__name__)


@dataclass
class BackStats:
    batches: int = 0
    examples: int = 0
    losses: list[float] = field(default_factory=list)
    per_device: collections.Counter[str] = field(default_factory=collections.Counter)
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)


class BackTrainer:
    """Trains ``model``'s blocks ``[start, N)`` on the stream ``segment`` of ``run``."""

    def __init__(
        self,
        channel: Channel,
        model: SplittableModel,
        start: int,
        run: str,
        segment: str,
        optimizer: OptimizerConfig | None = None,
        window: int = 4,
        group: str = "gpus",
    ) -> None:
        if not 0 < start < model.num_blocks:
            raise ValueError(
                f"start: a GPU server holds blocks [start, {model.num_blocks}) "
                f"with 0 < start < {model.num_blocks}, got {start}"
            )
        self.model, self.start = model, start
        self.blocks = nn.ModuleList(model.blocks[start:])
        self.optimizer = (optimizer or OptimizerConfig()).build(list(self.blocks.parameters()))
        self.granter = CreditGranter(channel, run, window)
        self.stats = BackStats()
        self._cut_specs = self._specs(model, start)
        self._lock = threading.Lock()
        channel.subscribe(
            topics.shared(group, topics.activations_filter(run, segment)),
            self._on_batch,
            kinds=frozenset({"activations"}),
        )

    @staticmethod
    def _specs(model: SplittableModel, start: int) -> dict[int, TensorSpec]:
        specs = {}
        with torch.no_grad():
            probe = torch.zeros(1, *model.input_shape)
            for index, block in enumerate(model.blocks):
                block.eval()
                probe = block(probe)
                block.train()
                if index + 1 >= start and index + 1 < model.num_blocks:
                    specs[index + 1] = TensorSpec("float32", (None, *probe.shape[1:]))
        return specs

    def open(self, device: str) -> None:
        """Let ``device`` start streaming (grants its credit window)."""
        self.granter.open(device)

    def _validate(self, envelope: Envelope) -> tuple[int, torch.Tensor, torch.Tensor]:
        cut = envelope.meta.get("cut")
        if not isinstance(cut, int) or cut not in self._cut_specs:
            raise WireError(
                "cut",
                f"cut {cut!r} is not one this server can continue from ({sorted(self._cut_specs)})",
            )
        x, y = envelope.tensors.get("x"), envelope.tensors.get("y")
        if x is None or y is None:
            raise WireError("payload", "an activation batch needs tensors 'x' and 'y'")
        self._cut_specs[cut].check("x", x)
        TensorSpec("int64", (x.shape[0],)).check("y", y)
        if y.min() < 0 or y.max() >= self.model.num_classes:
            raise WireError("labels", f"labels outside [0, {self.model.num_classes})")
        return cut, torch.from_numpy(x), torch.from_numpy(y)

    def _on_batch(self, envelope: Envelope) -> None:
        try:
            cut, inputs, labels = self._validate(envelope)
        except WireError as error:
            self.stats.rejected[error.reason] += 1
            log.warning("rejected activations from %s: %s", envelope.sender, error)
            self.granter.processed(envelope.sender)
            return
        with self._lock:
            self.optimizer.zero_grad(set_to_none=True)
            output = inputs
            for block in self.blocks[cut - self.start :]:
                output = block(output)
            loss = F.cross_entropy(output, labels)
            loss.backward()  # type: ignore[no-untyped-call]
            self.optimizer.step()
            self.stats.batches += 1
            self.stats.examples += len(labels)
            self.stats.losses.append(float(loss.detach()))
            self.stats.per_device[envelope.sender] += len(labels)
        self.granter.processed(envelope.sender)
