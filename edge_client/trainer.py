"""The edge's training loop: train the front segment with its local loss and stream the cut.

Each batch: wait for a credit from the GPU servers, take one optimizer step on the local loss,
wait until the broker has acknowledged the previous batch, send the detached activations and
labels. No gradient ever comes back (local-loss mode). In ``backprop`` mode (classic SplitFed,
for comparison) the edge sends the activations, waits for the server's gradient of them and
back-propagates it through its prefix.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import torch

from edge_client.source import Pace
from split_models.activations import Activation, activation_arrays, detached, primary
from split_models.cpu import process_cpu_share
from split_models.data import Dataset, batch_slices, shuffle_rng
from split_models.randomness import RandomStream, stream_seed
from split_models.segment import Segment, StepResult
from split_models.timing import LinkClock, StepClock
from wire import topics
from wire.channel import Channel
from wire.codec import Envelope
from wire.errors import WireError
from wire.flow import CreditGate
from wire.logs import printable
from wire.presence import PeerOffline
from wire.session import RoundAbandoned

__all__ = [
    "BatchRefused",
    "EdgeRoundReport",
    "EdgeTrainer",
    "EdgeTrainerConfig",
    "send_done",
    "send_done_after_failure",
]

log = logging.getLogger(__name__)
_POLL = 0.1


class BatchRefused(WireError):
    """The GPU server refused a splitfed batch (its activations not finite, out of range):
    no gradient will come for it, so the round fails now, saying why."""

    def __init__(self, seq: int, why: str) -> None:
        super().__init__("refused", f"the GPU server refused batch {seq}: {printable(why)}")


@dataclass(frozen=True)
class EdgeTrainerConfig:
    run: str
    device: str
    segment: str  # name of the server-side stream the activations feed
    batch_size: int = 32
    local_epochs: int = 1
    encoding: str = "fp32"
    credit_timeout: float = 60.0
    mode: str = "local-loss"  # or "backprop": the server sends the cut's gradient back


@dataclass(frozen=True)
class EdgeRoundReport:
    examples: int
    batches: int
    mean_loss: float
    bytes_sent: int
    credit_wait_seconds: float
    wall_seconds: float
    bytes_received: int = 0  # credits, and gradients in backprop mode
    cut_bytes_sent: int = 0  # the cut layer's traffic only: activations and labels up,
    cut_bytes_received: int = 0  # gradients down (backprop mode)
    # the timed steps (split_models.timing): the coordinator measures the device's speed
    compute: dict[str, float | list[int]] = field(default_factory=dict)


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
        self._gradients: queue.Queue[Envelope] = queue.Queue()
        self.rejected_gradients = 0
        self._offline: Callable[[], list[str]] | None = None  # the round's servers offline
        self._pace: Pace | None = None  # the round's turns on a shared host
        self._attempt, self._sent = 1, 0  # the try under way, its batches sent so far
        share = process_cpu_share(torch.get_num_threads())
        self.clock, self.link = StepClock(share=share), LinkClock()
        if config.mode == "backprop":
            channel.subscribe(
                topics.gradients(config.run, config.device),
                self._gradients.put,
                kinds=frozenset({"gradients"}),
            )

    def _gradient_for(
        self,
        seq: int,
        output: torch.Tensor,
        round_number: int,
        cancelled: Callable[[], bool] | None,
    ) -> torch.Tensor:
        # ``output``: the activation the gradient is of (side tensors at the cut take none)
        """Wait for the server's gradient of batch ``seq``; others (a retried round's, or a
        malformed one) are dropped with a count."""
        deadline = time.monotonic() + self.config.credit_timeout
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                envelope = self._gradients.get(timeout=min(remaining, _POLL))
            except queue.Empty:
                _check(cancelled, round_number, self._offline)
                continue
            gradient = envelope.tensors.get("g")
            if envelope.meta.get("seq") != seq or envelope.round != round_number:
                continue  # a gradient of an earlier batch or attempt
            if isinstance(why := envelope.meta.get("refused"), str):
                raise BatchRefused(seq, why)
            if gradient is None or tuple(gradient.shape) != tuple(output.shape):
                self.rejected_gradients += 1
                log.warning("dropped a gradient of shape %s", getattr(gradient, "shape", None))
                continue
            if gradient.dtype != np.float32 or not gradient.flags.writeable:
                gradient = np.array(gradient, dtype=np.float32)  # a decoded one is its own
            return torch.from_numpy(gradient)
        raise TimeoutError(
            f"no gradient from the GPU servers within {self.config.credit_timeout:.0f} s"
        )

    def _send(
        self,
        output: Activation,
        labels: torch.Tensor,
        round_number: int,
        backprop: bool = False,
    ) -> int:
        # the coordinator's try and the batch's place in it: a server refuses a replaced
        # try's batches, and its log names what it trained (docs/wire.md, "Counting")
        meta: dict[str, object] = {"cut": self.segment.end, "attempt": self._attempt}
        meta["batch"] = self._sent
        if backprop:
            meta["backprop"] = True
        # At most one batch in the transport's hands: the previous batch's message and packet
        # are released (the broker has acknowledged them) before this one is encoded. The
        # upload of batch k still overlaps the training step of batch k+1, but a slow uplink
        # cannot pile up the credit window's worth of payloads on top of the step, which the
        # plan's estimate (three payloads beyond the step) does not hold.
        began = time.perf_counter()
        self.channel.transport.flush(self.config.credit_timeout)
        self.link.acknowledged(time.perf_counter() - began)
        before = self.channel.stats.sent_by_kind["activations"]
        seq = self.channel.send(
            self.topic,
            "activations",
            self.config.run,
            round=round_number,
            tensors={**activation_arrays(output), "y": labels.numpy()},
            meta=meta,
            encoding=self.config.encoding,
        )
        self.link.published(self.channel.stats.sent_by_kind["activations"] - before)
        self._sent += 1
        return seq

    def _batch(
        self,
        batch: np.ndarray,
        round_number: int,
        step: Callable[[torch.Tensor, torch.Tensor], StepResult],
        cancelled: Callable[[], bool] | None = None,
    ) -> float | None:
        """Train and send one batch. Its tensors die with this call: the output of batch k
        (as large as the cut activations in fp32) must not stay alive through the step of
        batch k+1, which the plan's estimate does not hold."""
        inputs = torch.from_numpy(self.data.x[batch])
        labels = torch.from_numpy(self.data.y[batch])
        began, examples = self.clock.start(), {self.segment.end: len(batch)}
        if self.config.mode == "backprop":
            output = self.segment.forward_for_backprop(inputs)
            waiting = self.clock.start()  # the wait for the gradient is not compute
            seq = self._send(detached(output), labels, round_number, backprop=True)
            gradient = self._gradient_for(seq, primary(output), round_number, cancelled)
            paused = (waiting, self.clock.start())
            self.segment.backward_from(output, gradient)
            self.clock.add(began, examples, paused)  # forward and backward, no wait
            return None
        result = step(inputs, labels)
        self.clock.add(began, examples)
        self._send(result.output, labels, round_number)
        return result.loss

    def train_round(
        self,
        round_number: int,
        seed: int = 0,
        step: Callable[[torch.Tensor, torch.Tensor], StepResult] | None = None,
        cancelled: Callable[[], bool] | None = None,
        attempt: int | tuple[int, int] = 1,
        offline: Callable[[], list[str]] | None = None,
        pace: Pace | None = None,
    ) -> EdgeRoundReport:
        """``local_epochs`` passes over the local data; raises TimeoutError without credits.
        ``step`` trains one batch (default: the segment's own step; a simulation host passes
        one that trains this client together with others, see ``simulation.stack``).
        ``cancelled`` is asked while waiting for the servers (true: :class:`RoundAbandoned`),
        ``offline()`` too: the round's servers offline now (any: :class:`PeerOffline`).
        ``attempt``: the coordinator's try, or the try and the batch order it draws
        (:func:`wire.flower.order_of`; by default the try's number: a retry trains in
        another order). ``pace``: a shared host's turns for each batch."""
        attempt, order = attempt if isinstance(attempt, tuple) else (attempt, attempt)
        step = step or self.segment.train_step
        self._offline, self._pace, cancelled = offline, pace, _either(cancelled, offline)
        started, before = time.perf_counter(), self._counters()
        self._begin(round_number, (attempt, order), seed)
        batches = self._batches(shuffle_rng(seed, round_number, order))
        if pace is not None:
            pace.begin(len(batches))
        try:
            losses = self._train_all(batches, round_number, step, cancelled)
        except (RoundAbandoned, PeerOffline):
            raise  # a replaced try or a server gone: the servers' side ends it
        except Exception:
            self._give_up(round_number)
            raise
        self._done(round_number, len(batches))
        spent = [now - then for now, then in zip(self._counters(), before, strict=True)]
        return EdgeRoundReport(
            examples=sum(len(b) for b in batches),
            batches=len(losses),
            mean_loss=float(np.mean(losses)) if losses else float("nan"),  # none in backprop
            bytes_sent=int(spent[0]),
            bytes_received=int(spent[1]),
            cut_bytes_sent=int(spent[2]),
            cut_bytes_received=int(spent[3]),
            credit_wait_seconds=spent[4],
            wall_seconds=time.perf_counter() - started,
            compute={**self.clock.metrics(), **self.link.metrics()},
        )

    def _begin(self, round_number: int, tries: tuple[int, int], seed: int) -> None:
        """A round's (or a retry's) counters, credits and dropout masks: drawn from a stream
        of this seed, device, round and batch order, whatever else the process runs."""
        attempt, order = tries
        self.gate.start_round(round_number, attempt)  # a retried round: a new attempt
        self._attempt, self._sent = attempt, 0
        self.clock.reset()
        self.link.reset()
        device = self.config.device
        self.segment.random = RandomStream(stream_seed(seed, device, round_number, order))

    def _done(self, round_number: int, batches: int) -> None:
        """Say how many batches this try sent: every GPU server hears it, and the servers
        sharing the stream finish this edge's round when the batches they handled add up to
        it. Then one parseable log line of it (docs/wire.md, "Counting")."""
        config = self.config
        send_done(self.channel, config.run, config.device, round_number, batches, self._attempt)
        log.info(
            "batches-sent run=%s round=%d try=%d device=%s batches=%d",
            *(config.run, round_number, self._attempt, config.device, self._sent),
        )

    def _train_all(
        self,
        batches: list[np.ndarray],
        round_number: int,
        step: Callable[[torch.Tensor, torch.Tensor], StepResult],
        cancelled: Callable[[], bool] | None,
    ) -> list[float]:
        """Train and send ``batches``, each on a credit; their losses (none in backprop)."""
        losses: list[float] = []
        for batch in batches:
            if cancelled is not None and cancelled():  # a replaced try stops sending at once,
                _check(cancelled, round_number, self._offline)  # credits or not
            if not self.gate.acquire(self.config.credit_timeout, cancelled):
                _check(cancelled, round_number, self._offline)
                raise TimeoutError(
                    f"no credit from the GPU servers within {self.config.credit_timeout:.0f} s"
                )
            with self._pace.turn() if self._pace is not None else contextlib.nullcontext():
                loss = self._batch(batch, round_number, step, cancelled)
            if loss is not None:  # none in backprop mode
                losses.append(loss)
        return losses

    def _give_up(self, round_number: int) -> None:
        """Training failed mid-round: say how many batches went out, so the servers finish
        this edge's part with those at once instead of waiting for the rest until the
        round's deadline (the error goes to the coordinator in the reply)."""
        with _warned():
            self._done(round_number, self._sent)

    def _batches(self, generator: np.random.Generator) -> list[np.ndarray]:
        """The round's mini-batches: a permutation per local epoch, in order."""
        return self.batches_of(np.arange(len(self.data)), generator)

    def batches_of(self, rows: np.ndarray, generator: np.random.Generator) -> list[np.ndarray]:
        """Mini-batches of ``rows`` of the data: a permutation of them per local epoch, in
        order (of all rows, the permutation ``generator`` draws is the batch order itself)."""
        epochs = (rows[generator.permutation(len(rows))] for _ in range(self.config.local_epochs))
        return [batch for order in epochs for batch in batch_slices(order, self.config.batch_size)]

    def _counters(self) -> tuple[float, ...]:
        """Bytes sent, received, cut bytes sent, received, seconds waited for credits."""
        stats = self.channel.stats
        return (
            stats.bytes_sent,
            stats.bytes_received,
            stats.sent_by_kind["activations"],
            stats.received_by_kind["gradients"],
            self.gate.waited_seconds,
        )


def send_done(
    channel: Channel, run: str, device: str, round_number: int, batches: int, attempt: int
) -> None:
    """Tell the GPU servers how many batches ``device`` sent in try ``attempt`` of the round
    (docs/wire.md, "Counting"); raises what the transport raises."""
    meta = {"batches": batches, "attempt": attempt}
    channel.send(topics.done(run, device), "round_control", run, round=round_number, meta=meta)


@contextlib.contextmanager
def _warned() -> Iterator[None]:
    """A ``done`` after a failed round: the transport may be what failed, and the round's
    reply (the error) still goes, so a failure to send is a warning."""
    try:
        yield
    except Exception as error:
        log.warning("could not tell the GPU servers the round ended: %s", error)


def send_done_after_failure(
    channel: Channel, run: str, device: str, round_number: int, attempt: int
) -> None:
    """:func:`send_done` of 0 batches for a round that failed before training."""
    with _warned():
        send_done(channel, run, device, round_number, 0, attempt)


def _either(
    cancelled: Callable[[], bool] | None, offline: Callable[[], list[str]] | None
) -> Callable[[], bool] | None:
    """Stop waiting when the round is cancelled or one of its servers is offline."""
    if offline is None:
        return cancelled
    return lambda: bool(offline()) or (cancelled is not None and cancelled())


def _check(
    cancelled: Callable[[], bool] | None,
    round_number: int,
    offline: Callable[[], list[str]] | None = None,
) -> None:
    """Raise why waiting stopped: a server went offline, or the round was abandoned."""
    if offline is not None and (gone := offline()):
        raise PeerOffline(round_number, gone)
    if cancelled is not None and cancelled():
        raise RoundAbandoned(round_number)
