"""The GPU server's trainer: stage compute on a stream, plus chain forwarding.

:class:`BackTrainer` joins three small parts: the stage (:class:`~gpu_server.stage.BackStage`:
validate a batch for its cut, train it from there), the stream
(:class:`~wire.stream.StreamServer`: credits, the end-of-round agreement, parking of batches
of a round not begun yet, rejections that still cost only one batch) and, for a piece before
the last block, the chain link (:class:`~gpu_server.chain.ChainLink`) that passes each
trained batch on to the next piece. In ``backprop`` mode the last piece returns each batch's
input gradient to its sender.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gpu_server.chain import ChainLink
from gpu_server.stage import MAX_ACTIVATION, BackStage, Fill, Part
from split_models.activations import activation_arrays
from split_models.cpu import process_cpu_share
from split_models.randomness import RandomStream
from split_models.segment import OptimizerConfig, StepResult
from split_models.timing import StepClock
from split_models.weights import load_segment_state, segment_state
from split_models.zoo import SplittableModel
from wire import topics
from wire.channel import Channel
from wire.codec import Envelope
from wire.errors import WireError
from wire.flow import CreditGranter
from wire.stream import StreamServer

__all__ = ["BackStats", "BackTrainer"]

log = logging.getLogger(__name__)
_NEXT_WAIT = 30.0  # seconds a chain piece waits for the next piece to begin a round
_MAX_WHY = 500  # characters of a refused batch's reason told to its sender


@dataclass
class BackStats:
    """What this server trained (over all rounds) and what it rejected, by reason."""

    batches: int = 0
    examples: int = 0
    losses: list[float] = field(default_factory=list)
    per_device: collections.Counter[str] = field(default_factory=collections.Counter)
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)


class BackTrainer:
    """Trains ``model``'s blocks ``[start, end)`` on the stream ``segment`` of ``run``."""

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
        ordered: bool = False,
        max_activation: float = MAX_ACTIVATION,
        fill: int = 0,
        max_rows: int = 0,
    ) -> None:
        """``end`` below the model's last block makes this a piece of a chain: it trains with
        a ``local_loss`` head and passes its output on to the stream ``forward`` (at
        ``encoding``). ``ordered``: the stream hands batches on sender by sender, in name
        order (``deterministic: true``). ``fill``: local-loss batches smaller than this many
        examples train together, several senders' in a step (:class:`~gpu_server.stage.Fill`;
        0: each alone). ``max_rows``: larger batches are refused (``batch_size``; 0: none)."""
        end = model.num_blocks if end is None else end
        if (end < model.num_blocks) != (forward is not None):
            raise ValueError(
                f"forward: a server holding [{start}, {end}) of {model.num_blocks} blocks "
                f"{'needs' if end < model.num_blocks else 'takes no'} stream to pass its "
                f"output on to (got {forward!r}); only a piece before the last block has one"
            )
        limits = (max_activation, max_rows)
        self.stage = BackStage(model, start, end, local_loss, optimizer, device, *limits)
        self.model, self.start, self.end, self.forward = model, start, end, forward
        self.segment = self.stage.segment
        self.chain = None if forward is None else ChainLink(channel, run, forward, end, encoding)
        self.stream = StreamServer(channel, run, segment, self._train, window, group, ordered)
        self.stream.on_complete, self.stream.on_refused = self._complete, self._refuse
        self.fill = Fill(fill) if fill > 0 else None
        self.stats = BackStats(rejected=self.stream.stats.rejected)
        share = process_cpu_share(torch.get_num_threads())  # the clock: the coordinator's
        self.clock = StepClock(share=share, on_cpu=torch.device(device).type == "cpu")  # speeds
        self._round_examples, self._round_losses = 0, list[float]()
        self._round_senders: collections.Counter[str] = collections.Counter()
        # sender -> its batch numbers trained this round, each with how often
        self._round_batches: collections.defaultdict[str, collections.Counter[Any]] = (
            collections.defaultdict(collections.Counter)
        )

    @property
    def granter(self) -> CreditGranter:
        return self.stream.granter

    def close(self) -> None:
        """Leave the run's streams: a replaced trainer must not keep taking a share of the
        activations (the broker would still deliver a shared subscription's batches to it)."""
        self.stream.close()

    def begin_round(
        self,
        round_number: int,
        devices: Iterable[str],
        weights: Mapping[str, np.ndarray] | None = None,
        peers: Iterable[str] = (),
        proximal_mu: float = 0.0,
        attempt: int = 1,
        lr_scale: float = 1.0,
        random: RandomStream | None = None,
    ) -> None:
        """Load the round's weights, then open every device's credit window for the round.

        ``peers``: the other servers sharing the edges' streams this round (by name). Credits
        are granted only after the weights are in place, so no batch of the round is trained
        on the previous round's weights. ``proximal_mu``: FedProx's proximal weight, anchored
        at the round's weights. ``lr_scale``: the round's factor of the learning rate (its
        decay across rounds). ``random``: the stream its dropout masks are drawn from.
        """

        def setup() -> None:
            self.segment.lr_scale = lr_scale
            self.segment.random = random
            if weights is not None:
                load_segment_state(self.segment, weights)
                self.segment.reset_optimizer(proximal_mu)
            self._round_examples, self._round_losses = 0, []
            self.clock.reset()
            self._round_senders = collections.Counter()
            self._round_batches = collections.defaultdict(collections.Counter)
            if self.fill is not None:  # an earlier try's batches are not this round's
                self.fill.take()
            if self.chain is not None:  # a retried round counts its batches afresh
                self.chain.begin(round_number, attempt)

        chain = self.chain
        if chain is not None and not chain.await_next(round_number, attempt, _NEXT_WAIT):
            log.warning(
                "round %d: the next piece (stream %s) did not begin the round within %.0f s; "
                "passing batches on anyway",
                *(round_number, chain.forward, _NEXT_WAIT),
            )
        self.stream.begin_round(round_number, devices, peers, setup, attempt)

    def part(self) -> None:
        """Take no batches until the next round (see :meth:`StreamServer.part`)."""
        self.stream.part()

    def wait_round(
        self,
        devices: Iterable[str],
        timeout: float,
        cancelled: Callable[[], bool] | None = None,
        offline: Callable[[], Iterable[str]] | None = None,
        quiet: float | None = None,
    ) -> tuple[int, float]:
        """Block until every device is finished or went offline (``offline()``: the devices
        offline now; see :meth:`StreamServer.wait_round`), the timeout passes, or
        ``cancelled()`` turns true; return the examples trained in the round and their mean
        loss (a device that went offline: all of its batches that arrived before)."""
        self.stream.wait_round(timeout, cancelled, wanted=devices, offline=offline, quiet=quiet)
        with self.stream.exclusive():
            self._flush()
            losses = list(self._round_losses)
            return self._round_examples, float(np.mean(losses)) if losses else float("nan")

    def round_senders(self) -> dict[str, int]:
        """The examples trained in the current round per sender (an edge, or the piece before
        this one in a chain), over every local epoch; refused batches count not."""
        with self.stream.exclusive():
            return dict(self._round_senders)

    def round_batches(self) -> dict[str, tuple[int, int]]:
        """Per sender, the batches trained in the current round and how many of them were
        distinct (by the sender's batch number: fewer means one was trained twice)."""
        with self.stream.exclusive():
            return {s: (c.total(), len(c)) for s, c in self._round_batches.items()}

    @property
    def finished(self) -> set[str]:
        """The devices whose batches of the current round have all been handled."""
        return self.stream.finished

    def missing(self, quiet: float) -> dict[str, int]:
        """The devices missing batches of the current round (see :meth:`StreamServer.missing`)."""
        return self.stream.missing(quiet)

    @property
    def gone(self) -> set[str]:
        """The devices that went offline during the current round (their part ended)."""
        return self.stream.gone

    def state(self) -> dict[str, np.ndarray]:
        """The back segment's tensors under their global names."""
        with self.stream.exclusive():  # not in the middle of a step
            self._flush()
            return segment_state(self.segment)

    def timing(self) -> dict[str, float | list[int]]:
        """The round's timed steps (reply metrics), read between steps."""
        with self.stream.exclusive():
            return self.clock.metrics()

    def _train(self, envelope: Envelope) -> None:
        """One batch of the current round (the stream calls this, one batch at a time)."""
        if self.fill is not None and envelope.meta.get("backprop") is not True:
            for parts in self.fill.add(self.stage.prepare(envelope)):
                self._train_parts(parts)
            return
        began = self.clock.start()
        result, labels = self.stage.train(envelope)
        self.clock.add(began, {_cut_of(envelope): len(labels)})
        if result.input_gradient is not None:
            self._return_gradient(envelope, result)
        self._trained([(envelope, len(labels))], result, labels)

    def _train_parts(self, parts: list[Part]) -> None:
        """One step on batches the fill held; when its loss is not finite, each batch alone
        (so one sender's bad batch costs the others nothing)."""
        try:
            began = self.clock.start()
            result = self.stage.train_parts(parts)
            self.clock.add(began, {parts[0].cut: sum(p.rows for p in parts)})
        except WireError as error:
            if len(parts) > 1:
                for part in parts:
                    self._train_parts([part])
                return
            self.stream.rejected(parts[0].envelope.sender, error)
            return
        labels = torch.cat([p.labels for p in parts]) if len(parts) > 1 else parts[0].labels
        self._trained([(p.envelope, p.rows) for p in parts], result, labels)

    def _trained(
        self, batches: list[tuple[Envelope, int]], result: StepResult, labels: torch.Tensor
    ) -> None:
        """Count ``batches`` (each with its examples) trained by one step; a chain passes the
        step's output on."""
        for envelope, examples in batches:
            self._count(envelope.sender, examples, result.loss)
            batch = envelope.meta.get("batch")  # a sender's own count: any JSON it wrote
            self._round_batches[envelope.sender][batch if type(batch) is int else None] += 1
        if self.chain is not None:
            output = activation_arrays(result.output)
            self.chain.pass_on(output, labels.cpu().numpy(), batches[0][0].round)

    def _flush(self) -> None:
        """Train what the fill holds (the round's last batches)."""
        for parts in self.fill.take() if self.fill is not None else ():
            self._train_parts(parts)

    def _complete(self, number: int) -> None:
        """Every sender finished: train what is held, then tell the next piece."""
        with self.stream.exclusive():
            self._flush()
        if self.chain is not None:
            self.chain.done(number)

    def _count(self, sender: str, examples: int, loss: float) -> None:
        self.stats.batches += 1
        self.stats.examples += examples
        self.stats.losses.append(loss)
        self.stats.per_device[sender] += examples
        self._round_examples += examples
        self._round_senders[sender] += examples
        self._round_losses.append(loss)

    def _refuse(self, sender: str, round_number: int, seq: int, why: str) -> None:
        """Tell ``sender`` its batch ``seq`` was refused: in splitfed it waits for that batch's
        gradient, and would wait out the round's deadline (a local-loss edge hears nothing:
        it does not listen for gradients)."""
        self.stream.channel.send(
            topics.gradients(self.stream.run, sender),
            "gradients",
            self.stream.run,
            round=round_number,
            meta={"seq": seq, "refused": why[:_MAX_WHY]},
        )

    def _return_gradient(self, envelope: Envelope, result: StepResult) -> None:
        if result.input_gradient is None:
            raise AssertionError("only a backprop-mode step returns an input gradient")
        self.stream.channel.send(
            topics.gradients(envelope.run, envelope.sender),
            "gradients",
            envelope.run,
            round=envelope.round,
            tensors={"g": result.input_gradient.cpu().numpy()},
            meta={"seq": envelope.seq, "loss": result.loss},
        )


def _cut_of(envelope: Envelope) -> int:
    """The cut a trained batch entered at (the stage checked it is an int)."""
    cut = envelope.meta.get("cut")
    return cut if isinstance(cut, int) else -1
