"""The GPU server's training loop: train the back blocks on every edge's activation stream.

The server holds blocks ``[start, N)``; an activation batch cut after block ``s - 1`` (``s >=
start``) enters at block ``s`` and trains blocks ``[s, N)`` with the task loss. Each processed
batch returns a credit to its edge. Batches are validated against the shape the declared cut
must have; a bad one is counted and dropped, and its credit still returned so the edge does not
stall.

A back too large for one server is split over a chain of servers: a server holding ``[start,
end)`` with ``end < N`` trains its piece with a local-loss head at ``end`` (no gradient comes
back, as on an edge) and passes each batch's output and labels on to the next piece's stream,
marking the batch after which all of its round's senders are finished as its last.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from split_models.segment import OptimizerConfig, Segment
from split_models.weights import load_segment_state, segment_state
from split_models.zoo import SplittableModel
from wire import topics
from wire.channel import Channel
from wire.codec import Envelope, TensorSpec
from wire.errors import WireError
from wire.flow import CreditGranter

__all__ = ["BackStats", "BackTrainer"]

log = logging.getLogger(__name__)
_MAX_PARKED = 64  # batches of a round this server has not begun yet


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
        device: str = "cpu",
        end: int | None = None,
        local_loss: str = "linear",
        forward: str | None = None,
        encoding: str = "fp32",
    ) -> None:
        """``end`` below the model's last block makes this a piece of a chain: it trains with
        a ``local_loss`` head and passes its output on to the stream ``forward`` (at
        ``encoding``)."""
        end = model.num_blocks if end is None else end
        if not 0 < start < end <= model.num_blocks:
            raise ValueError(
                f"blocks: a GPU server holds [start, end) with 0 < start < end <= "
                f"{model.num_blocks}, got [{start}, {end})"
            )
        if (end < model.num_blocks) != (forward is not None):
            raise ValueError(
                "a server that holds a piece before the last block needs the stream to pass "
                "its output on to (forward), and only such a server has one"
            )
        self.model, self.start, self.end, self.forward = model, start, end, forward
        self.encoding = encoding
        self.device = torch.device(device)
        # the last piece gets the task loss, any other a local-loss head
        self.segment = Segment.from_model(model, start, end, local_loss, optimizer=optimizer)
        self.segment.module.to(self.device)  # in place: the optimizer keeps its parameters
        self.granter = CreditGranter(channel, run, window)
        self.stats = BackStats()
        self._cut_specs = self._specs(model, start, end)
        self._lock = threading.Lock()
        self._round_done = threading.Condition(self._lock)
        self._round = 0
        self._round_examples = 0
        self._round_losses: list[float] = []
        self._finished: set[str] = set()
        self._senders: set[str] = set()  # who streams into this server this round
        self._forwarded = 0
        # Sharing a stream with peer servers: a round ends for an edge when the batches all
        # servers trained add up to what the edge says it sent.
        self.name = channel.sender
        self._peers: set[str] = set()
        self._expected: dict[str, int] = {}
        self._counts: dict[str, collections.Counter[str]] = {}
        self._parked: list[tuple[int, torch.Tensor, torch.Tensor, Envelope]] = []
        self._early_done: dict[tuple[int, str], int] = {}
        self._early_counts: dict[tuple[int, str], dict[str, int]] = {}
        control = frozenset({"round_control"})
        self._filters = (
            topics.run_topic(run, "done") + "/+",
            topics.run_topic(run, "processed") + "/+",
            topics.shared(group, topics.activations_filter(run, segment)),
        )
        channel.subscribe(self._filters[0], self._on_done, kinds=control)
        channel.subscribe(self._filters[1], self._on_counts, kinds=control)
        channel.subscribe(self._filters[2], self._on_batch, kinds=frozenset({"activations"}))

    def close(self) -> None:
        """Leave the run's streams: a replaced trainer must not keep taking a share of the
        activations (the broker would still deliver a shared subscription's batches to it)."""
        for topic_filter in self._filters:
            self.granter.channel.transport.unsubscribe(topic_filter)

    @staticmethod
    def _specs(model: SplittableModel, start: int, end: int) -> dict[int, TensorSpec]:
        specs = {}
        with torch.no_grad():
            probe = torch.zeros(1, *model.input_shape)
            for index, block in enumerate(model.blocks):
                block.eval()
                probe = block(probe)
                block.train()
                if start <= index + 1 < end:
                    specs[index + 1] = TensorSpec("float32", (None, *probe.shape[1:]))
        return specs

    def begin_round(
        self,
        round_number: int,
        devices: Iterable[str],
        weights: Mapping[str, np.ndarray] | None = None,
        peers: Iterable[str] = (),
    ) -> None:
        """Load the round's weights, then open every device's credit window for the round.

        ``peers``: the other servers sharing the edges' streams this round (by name).

        Credits are granted only after the weights are in place, so no batch of the round is
        trained on the previous round's weights.
        """
        with self._lock:
            if weights is not None:
                load_segment_state(self.segment, weights)
                self.segment.reset_optimizer()
            self._round, self._round_examples = round_number, 0
            self._round_losses, self._finished = [], set()
            self._senders, self._forwarded = set(devices), 0
            self._peers = set(peers) - {self.name}
            self._expected, self._counts = {}, {self.name: collections.Counter()}
            if self._peers:  # what peers and edges said before this server began the round
                for (number, device), batches in self._early_done.items():
                    if number == round_number:
                        self._expected[device] = batches
                for (number, peer), counts in self._early_counts.items():
                    if number == round_number and peer in self._peers:
                        self._counts[peer] = collections.Counter(counts)
            self._early_done = {k: v for k, v in self._early_done.items() if k[0] > round_number}
            self._early_counts = {
                k: v for k, v in self._early_counts.items() if k[0] > round_number
            }
        self._replay_parked()
        if self._peers:
            self._publish_counts()
            self._check_finished()
        for device in self._senders:
            self.granter.open(device, round_number)

    def wait_round(
        self,
        devices: Iterable[str],
        timeout: float,
        cancelled: Callable[[], bool] | None = None,
    ) -> tuple[int, float]:
        """Block until every device sent its last batch of the round (or the timeout passes,
        or ``cancelled()`` turns true); return the examples trained in the round and their
        mean loss."""
        wanted = set(devices)
        deadline = time.monotonic() + timeout
        with self._round_done:
            while not wanted <= self._finished and time.monotonic() < deadline:
                if cancelled is not None and cancelled():
                    break
                self._round_done.wait(0.1)
            losses = self._round_losses
            return self._round_examples, float(np.mean(losses)) if losses else float("nan")

    @property
    def finished(self) -> set[str]:
        """The devices whose last batch of the current round has been trained."""
        with self._lock:
            return set(self._finished)

    def state(self) -> dict[str, np.ndarray]:
        """The back segment's tensors under their global names."""
        with self._lock:
            return segment_state(self.segment)

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
            self._count(envelope)
            self.granter.processed(envelope.sender, envelope.round)
            return
        with self._lock:
            if envelope.round > self._round:
                # A peer server began the round first; this one has not loaded its weights.
                if len(self._parked) < _MAX_PARKED:
                    self._parked.append((cut, inputs, labels, envelope))
                    return  # trained (and its credit returned) when the round begins here
                self.stats.rejected["ahead"] += 1
            elif envelope.round < self._round:
                self.stats.rejected["stale_round"] += 1  # its weights have been replaced
            else:
                self._train(cut, inputs, labels, envelope)
        self._count(envelope)
        self.granter.processed(envelope.sender, envelope.round)

    def _replay_parked(self) -> None:
        with self._lock:
            ready = [p for p in self._parked if p[3].round == self._round]
            self._parked = [p for p in self._parked if p[3].round > self._round]
            for cut, inputs, labels, envelope in ready:
                self._train(cut, inputs, labels, envelope)
        for *_, envelope in ready:
            self._count(envelope)
            self.granter.processed(envelope.sender, envelope.round)

    # ---------------------------------------------------------------- sharing with peers
    def _count(self, envelope: Envelope) -> None:
        with self._lock:
            if envelope.round != self._round or not self._peers:
                return
            self._counts[self.name][envelope.sender] += 1
            publish = envelope.sender in self._expected
        if publish:
            self._publish_counts()
        self._check_finished()

    def _publish_counts(self) -> None:
        with self._lock:
            counts, number = dict(self._counts[self.name]), self._round
        self.granter.channel.send(
            topics.processed(self.granter.run, self.name),
            "round_control",
            self.granter.run,
            round=number,
            meta={"counts": counts},
        )

    def _on_done(self, envelope: Envelope) -> None:
        batches = envelope.meta.get("batches")
        if not isinstance(batches, int) or batches < 0:
            self.stats.rejected["done"] += 1
            return
        with self._lock:
            if envelope.round > self._round:
                self._early_done[(envelope.round, envelope.sender)] = batches
                return
            if envelope.round != self._round or not self._peers:
                return
            self._expected[envelope.sender] = batches
        self._publish_counts()
        self._check_finished()

    def _on_counts(self, envelope: Envelope) -> None:
        raw = envelope.meta.get("counts")
        if not isinstance(raw, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and v >= 0 for k, v in raw.items()
        ):
            self.stats.rejected["counts"] += 1
            return
        counts: dict[str, int] = raw
        if envelope.sender == self.name:
            return
        with self._lock:
            if envelope.round > self._round:
                self._early_counts[(envelope.round, envelope.sender)] = counts
                return
            if envelope.round != self._round or envelope.sender not in self._peers:
                return
            self._counts[envelope.sender] = collections.Counter(counts)
        self._check_finished()

    def _check_finished(self) -> None:
        with self._round_done:
            for device, expected in self._expected.items():
                trained = sum(c[device] for c in self._counts.values())
                if trained >= expected and device not in self._finished:
                    self._finished.add(device)
                    self._round_done.notify_all()

    def _train(
        self, cut: int, inputs: torch.Tensor, labels: torch.Tensor, envelope: Envelope
    ) -> None:
        optimizer = self.segment.optimizer
        optimizer.zero_grad(set_to_none=True)
        backprop = envelope.meta.get("backprop") is True and self.forward is None
        inputs, labels = inputs.to(self.device), labels.to(self.device)
        if backprop:
            inputs = inputs.detach().requires_grad_(True)
        output = inputs
        blocks = list(self.segment.module.children())
        for block in blocks[cut - self.start :]:
            output = block(output)
        if self.forward is None:
            loss = F.cross_entropy(output, labels)
        else:
            loss = self.segment.head.loss(output, labels)
        loss.backward()  # type: ignore[no-untyped-call]
        optimizer.step()
        value = float(loss.detach())
        if backprop and inputs.grad is not None:
            self.granter.channel.send(
                topics.gradients(envelope.run, envelope.sender),
                "gradients",
                envelope.run,
                round=envelope.round,
                tensors={"g": inputs.grad.detach().cpu().numpy()},
                meta={"seq": envelope.seq, "loss": value},
            )
        self.stats.batches += 1
        self.stats.examples += len(labels)
        self.stats.losses.append(value)
        self.stats.per_device[envelope.sender] += len(labels)
        self._round_examples += len(labels)
        self._round_losses.append(value)
        if envelope.meta.get("last") is True and not self._peers:
            self._finished.add(envelope.sender)
            self._round_done.notify_all()
        if self.forward is not None:
            self._pass_on(output.detach(), labels, envelope.round)

    def _pass_on(self, output: torch.Tensor, labels: torch.Tensor, round_number: int) -> None:
        """Send a trained batch's output to the next piece of the chain (called under the
        lock, so the batch that finishes the round is the one marked last)."""
        if self.forward is None:
            raise AssertionError("only a piece before the last block passes batches on")
        last = bool(self._senders) and self._senders <= self._finished
        self.granter.channel.send(
            topics.activations(self.granter.run, self.forward, self.name),
            "activations",
            self.granter.run,
            round=round_number,
            tensors={"x": output.cpu().numpy(), "y": labels.cpu().numpy()},
            meta={"cut": self.end, "last": last},
            encoding=self.encoding,
        )
        self._forwarded += 1
