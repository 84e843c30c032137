"""The server side of a run's activation stream: credits, the end of a round, parking.

A :class:`StreamServer` takes one stream (``<run>/act/<segment>/+``, through a shared
subscription so several servers split it) and hands each batch of the round it serves to a
handler, the stage's compute. Around that it owns:

- **credits** (:class:`~wire.flow.CreditGranter`): a window per sender when the round opens,
  one back per batch handled, trained or rejected;
- **the end of a round** (:class:`~wire.agreement.RoundLedger`): senders' ``done`` counts and
  peers' ``processed`` counts; a sender is finished when they add up;
- **parking**: batches of a round this server has not begun yet (a peer began first) wait,
  bounded, until it has the round's weights.

A batch rejected anywhere (codec or handler, which may raise anything) costs one batch:
its credit returns, it is counted, and ``on_refused`` hears of it (a splitfed sender awaits
its gradient), so the round does not wait out its deadline for it. A rejection trusts only
the topic for the sender (the ACL binds it) and takes round, epoch and sequence number from
its header; rejections are de-duplicated per round and bounded. A batch from a device that
is not one of the round's senders is rejected (``sender``) without a credit or a count.
Between its rounds a server takes no batches (:meth:`StreamServer.part`; the next round
joins the stream again before its credits).

**A sender that goes offline** (its will, passed to :meth:`StreamServer.wait_round`, or
:meth:`StreamServer.leave`) leaves the round: nobody waits for its count, every batch of it
that came before the will is trained (**all in**), one after is refused (``gone``).

**Ordered** (``ordered=True``, ``deterministic: true``, one server on the stream): a round's
batches are handled sender by sender in name order, each sender's as they came; a batch not
in its turn waits, its credit returning when handled. The back trains on the same sequence
in every run, whatever order the network delivered; senders take turns, so rounds are longer.

**Gaps** (a broker that lost acknowledged messages): a sender whose ``done`` and batches do
not add up, with no progress for a quiet period, is **missing** batches
(:meth:`StreamServer.missing`); its owner reports it and the round is redone, never committed
short. **Tries**: a batch or ``done`` of an earlier try (``attempt``) of the current round is
refused (``stale_attempt``) without a credit or a count.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from wire import topics
from wire.agreement import RoundLedger, SenderMajor
from wire.channel import Channel, Rejection
from wire.codec import Envelope
from wire.errors import WireError
from wire.flow import CreditGranter
from wire.logs import warn
from wire.stream_records import EarlyNotes, ParkingLot, StreamStats, envelope_attempt, sender_of

__all__ = ["StreamServer", "StreamStats"]

log = logging.getLogger(__name__)
# Bounds on what is kept for rounds not begun or batches rejected, per sender and in all.
_MAX_PARKED, _PARKED_PER_SENDER = 1024, 32  # batches of a round this server has not begun yet
_MAX_EARLY, _EARLY_PER_SENDER = 4096, 8  # done / processed messages of rounds not begun yet
_MAX_REJECTIONS, _REJECTIONS_PER_SENDER = 65536, 1024  # rejections counted per round
_POLL = 0.1


# what a sender is told of a batch the handler failed on (an exception, not a check): the
# exception's text may name this server's internals, and is logged here instead
_UNFORESEEN = "error: the server failed to train this batch (the server's log says why)"


class StreamServer:
    """Serves the stream ``segment`` of ``run`` for ``channel.sender``; ``handle`` computes
    one batch of the current round (under the stream's lock, one at a time) and raises
    :class:`WireError` to reject it (anything else it raises rejects it too)."""

    def __init__(
        self,
        channel: Channel,
        run: str,
        segment: str,
        handle: Callable[[Envelope], None],
        window: int = 4,
        group: str = "gpus",
        ordered: bool = False,
    ) -> None:
        """``ordered``: handle each round's batches sender by sender (see the module's
        docstring); no effect with peers sharing the stream (no server sees every batch)."""
        self.channel, self.run, self.name = channel, run, channel.sender
        self.ordered = ordered
        self._order: SenderMajor | None = None
        self.granter = CreditGranter(channel, run, window)
        self.stats = StreamStats()
        self.on_complete: Callable[[int], None] | None = None  # every sender finished
        # a batch of the round refused: (sender, round, seq, why), for a sender awaiting it
        self.on_refused: Callable[[str, int, int, str], None] | None = None
        self._handle = handle
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._ledger = RoundLedger(0, (), self.name)
        self._attempt = 1  # the coordinator's try of the current round
        self._progress: dict[str, float] = {}  # sender -> when its latest batch or done came
        self._parked = ParkingLot(_MAX_PARKED, _PARKED_PER_SENDER)
        self._early = EarlyNotes(_MAX_EARLY, _EARLY_PER_SENDER)
        self._rejections: set[tuple[int, str, str, int]] = set()  # (round, sender, epoch, seq)
        self._rejections_by: collections.Counter[str] = collections.Counter()  # per sender
        control = frozenset({"round_control"})
        self._filters = (
            topics.run_topic(run, "done") + "/+",
            topics.run_topic(run, "processed") + "/+",
            topics.shared(group, topics.activations_filter(run, segment)),
        )
        channel.listen(self._filters[0], self._on_done, kinds=control)
        channel.listen(self._filters[1], self._on_counts, kinds=control)
        self._joined = False
        self.join()

    def close(self) -> None:
        """Leave the stream: a replaced server must not keep taking a share of it."""
        for topic_filter in self._filters:
            self.channel.transport.unsubscribe(topic_filter)
        with self._lock:
            self._parked.clear()

    def join(self) -> None:
        """Take a share of the stream's batches (again: each round it serves begins so)."""
        if not self._joined:
            kinds = frozenset({"activations"})
            self.channel.listen(self._filters[2], self._on_batch, None, kinds, self._on_reject)
            self._joined = True

    def part(self) -> None:
        """Take no batches until the next round: a server the next plan leaves out must not
        keep taking a share of its old piece's stream."""
        if self._joined:
            self.channel.transport.unsubscribe(self._filters[2])
            self._joined = False

    # ---------------------------------------------------------------- rounds
    def begin_round(
        self,
        number: int,
        senders: Iterable[str],
        peers: Iterable[str] = (),
        setup: Callable[[], None] | None = None,
        attempt: int = 1,
    ) -> None:
        """Serve round ``number`` for ``senders`` (with ``peers`` sharing the stream): run
        ``setup`` (load the round's weights) before any batch of the round is handled, train
        what was parked for it, then open every sender's credit window."""
        self.join()
        with self._lock:
            if setup is not None:
                setup()
            self._ledger = RoundLedger(number, senders, self.name, peers)
            self._attempt, self._progress = attempt, {}
            alone = not self._ledger.peers
            self._order = SenderMajor(self._ledger.senders) if self.ordered and alone else None
            # rejections parked for this round or a later one keep their keys: a redelivered
            # copy must not count twice
            self._rejections = {k for k in self._rejections if k[0] >= number}
            self._rejections_by = collections.Counter(k[1] for k in self._rejections)
            self._apply_early(number)
            ready = self._parked.take(number)
            strangers = [p for p in ready if p.sender not in self._ledger.senders]
            ready = [p for p in ready if p.sender in self._ledger.senders]
            for _stranger in (p for p in strangers if p.envelope is not None):
                self.stats.rejected["sender"] += 1  # a parked rejection was counted already
            handled = [s for p in ready for s in self._admit(p.sender, p.envelope)]
            for parked in ready:
                if parked.refusal is not None:
                    self._tell_refused(parked.sender, number, *parked.refusal)
            handled += self._drain()  # a sender that said 'done' early may be finished
        for sender in handled:
            self.granter.processed(sender, number)
        if self._ledger.peers:
            self._publish_counts()
        self._settle()
        self.granter.attempt = attempt  # the senders' gates take only this attempt's credits
        for sender in sorted(self._ledger.senders):
            self.granter.open(sender, number)

    def wait_round(
        self,
        timeout: float,
        cancelled: Callable[[], bool] | None = None,
        wanted: Iterable[str] | None = None,
        offline: Callable[[], Iterable[str]] | None = None,
        quiet: float | None = None,
    ) -> bool:
        """Block until every sender of the round (or of ``wanted``) is finished or left
        (True), the timeout passes or ``cancelled()`` turns true (False). ``offline()``: the
        devices offline now, asked while waiting; a sender among them leaves the round.
        ``quiet``: also stop (False) once every sender still waited for is missing batches
        for that long (:meth:`missing`)."""
        deadline = time.monotonic() + timeout
        while True:
            for device in offline() if offline is not None else ():
                self.leave(device)
            with self._changed:
                want = self._ledger.senders if wanted is None else frozenset(wanted)
                open_ = want - self._ledger.finished - self._ledger.gone
                if not open_:
                    return True
                stuck = quiet is not None and open_ <= set(self._missing(quiet))
                if stuck or time.monotonic() >= deadline or (cancelled and cancelled()):
                    return False
                self._changed.wait(min(_POLL, max(0.0, deadline - time.monotonic())))

    def leave(self, sender: str) -> bool:
        """End ``sender``'s part of the current round (it went offline, or failed): nobody
        waits for its count; False when it is no sender of the round, or finished or left
        already."""
        with self._changed:
            was, number = self._ledger.complete, self._ledger.number
            if not self._ledger.leave(sender):
                return False
            self.stats.left[sender] += 1
            handled = self._drain()  # ordered: its waiting batches, then the next sender's
            completed = not was and self._ledger.complete
            self._changed.notify_all()
        log.warning(
            "round %d: %s's part ends: it went offline or failed, or a peer server went offline",
            number,
            sender,
        )
        self._credit(handled, number)
        if completed and self.on_complete is not None:
            self.on_complete(number)
        return True

    def missing(self, quiet: float) -> dict[str, int]:
        """The senders of the current round that said what they sent, whose batches do not
        add up, and of which nothing came for ``quiet`` seconds: how many batches each
        misses (lost, not late)."""
        with self._lock:
            return self._missing(quiet)

    def _missing(self, quiet: float) -> dict[str, int]:
        now = time.monotonic()
        return {
            sender: short
            for sender, short in self._ledger.short().items()
            if now - self._progress.get(sender, now) >= quiet
        }

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        """No batch is handled and no round begins while this is held."""
        with self._lock:
            yield

    @property
    def finished(self) -> set[str]:
        """The senders of the current round whose batches have all been handled."""
        with self._lock:
            return set(self._ledger.finished)

    @property
    def gone(self) -> set[str]:
        """The senders of the current round that left it (went offline)."""
        with self._lock:
            return set(self._ledger.gone)

    @property
    def round_number(self) -> int:
        with self._lock:
            return self._ledger.number

    # ---------------------------------------------------------------- batches
    def _on_batch(self, topic: str, envelope: Envelope) -> None:
        sender = sender_of(topic)
        if envelope.sender != sender:
            epoch = envelope.meta.get("epoch")
            self._reject(sender, envelope.round, (epoch, envelope.seq), "sender")
            return
        with self._lock:
            number = self._ledger.number
            if envelope.round > number and self._parked.admit(
                number, envelope.round, sender, envelope
            ):
                return  # handled (and its credit returned) when the round begins here
            if envelope.round == number and sender not in self._ledger.senders:
                self._stranger(sender, number)
                return  # no credit, no count: it is not one of the round's senders
            if envelope.round == number and envelope_attempt(envelope) < self._attempt:
                self.stats.rejected["stale_attempt"] += 1  # a replaced try's: no credit
                return
            if envelope.round == number and sender in self._ledger.gone:
                self.stats.rejected["gone"] += 1  # arrived after its will: not trained
                handled = [sender]  # its credit returns (a device back online is not stalled)
            elif envelope.round != number:
                reason = "stale_round" if envelope.round < number else "ahead"
                self.stats.rejected[reason] += 1
                handled = [sender]  # its credit returns, though it counts for no round
            else:
                handled = self._admit(sender, envelope)
        self._credit(handled, envelope.round)

    def _stranger(self, sender: str, number: int) -> None:
        self.stats.rejected["sender"] += 1
        warn(
            log,
            (sender, "sender"),
            "rejected activations from %s: not a sender of round %d",
            sender,
            number,
        )

    def _admit(self, sender: str, envelope: Envelope | None) -> list[str]:
        """Handle a batch of the current round now, or (ordered) when its turn comes; the
        senders of the batches handled by this call."""
        self._progress[sender] = time.monotonic()  # arrived: not missing, even if queued
        if self._order is None:
            self._handle_locked(sender, envelope)
            return [sender]
        if len(self._order.queues[sender]) >= self.granter.window:
            # more than its credits allow: the sender ignores the protocol; nothing of it is
            # kept beyond its window (an honest sender never gets here)
            self.stats.rejected["over_window"] += 1
            log.warning("dropped a batch of %s: more batches waiting than its credits", sender)
            return []
        self._order.push(sender, envelope)
        return self._drain()

    def _drain(self) -> list[str]:
        if self._order is None:
            return []
        return self._order.drain(self._handled_all, self._handle_locked)

    def _handled_all(self, sender: str) -> bool:
        """Ordered: ``sender`` said what it sent, and this server handled all of it."""
        declared = self._ledger.declared.get(sender)
        if sender in self._ledger.gone:
            return True  # its batches that came before its will were handled
        return declared is not None and self._ledger.own_counts.get(sender, 0) >= declared

    def _credit(self, senders: list[str], number: int) -> None:
        """One credit back for each batch handled, then the counts move on."""
        for sender in senders:
            self.granter.processed(sender, number)
        for sender in dict.fromkeys(senders):
            self._after_count(sender)

    def _handle_locked(self, sender: str, envelope: Envelope | None) -> None:
        if envelope is not None:
            batch = (envelope.round, envelope.seq)
            try:
                self._handle(envelope)
            except WireError as error:
                self.rejected(sender, error, batch)
            except Exception as error:  # unforeseen: that batch's failure, not the round's
                unforeseen = WireError("error", f"{type(error).__name__}: {error}")
                self.rejected(sender, unforeseen, batch, _UNFORESEEN)
        if self._ledger.handled(sender):
            self.stats.handled[sender] += 1
            self._progress[sender] = time.monotonic()

    def rejected(
        self,
        sender: str,
        error: WireError,
        batch: tuple[int, int] | None = None,
        told: str | None = None,
    ) -> None:
        """Count and log a batch of ``sender`` that was handled but not trained (``batch``: its
        round and sequence number, told to ``on_refused`` with ``told``, or the error when
        none: the handler's own failures stay in this server's log)."""
        self.stats.rejected[error.reason] += 1
        warn(log, (sender, error.reason), "rejected activations from %s: %s", sender, error)
        if batch is not None:
            self._tell_refused(sender, *batch, told or str(error))

    def _tell_refused(self, sender: str, number: int, seq: int, why: str) -> None:
        """``on_refused``, whose failure (a transport closing) costs only the message."""
        try:
            if self.on_refused is not None:
                self.on_refused(sender, number, seq, why)
        except Exception as error:  # the batch is still counted and its credit returned
            warn(log, (sender, "refusal"), "could not tell %s of a refusal: %s", sender, error)

    def _on_reject(self, rejection: Rejection) -> None:
        header = rejection.header
        number, seq = header.get("round"), header.get("seq")
        if header.get("kind") != "activations" or number is None or seq is None:
            self.stats.rejected[rejection.reason] += 1
            return  # not attributable to a batch of a round: counted in the stats only
        key = (header.get("epoch"), seq)
        self._reject(sender_of(rejection.topic), number, key, rejection.reason, rejection.detail)

    def _reject(
        self, sender: str, number: int, key: tuple[Any, int], reason: str, detail: str = ""
    ) -> None:
        """Count a batch of ``sender`` rejected before the handler (``detail``: why, in
        words), once per round."""
        with self._lock:
            current = self._ledger.number
            if number == current and sender not in self._ledger.senders:
                self._stranger(sender, number)
                return
            self.stats.rejected[reason] += 1
            seen = (number, sender, str(key[0]), key[1])
            if number < current or seen in self._rejections:
                return
            if (
                len(self._rejections) >= _MAX_REJECTIONS
                or self._rejections_by[sender] >= _REJECTIONS_PER_SENDER
            ):
                return
            self._rejections.add(seen)
            self._rejections_by[sender] += 1
            if number > current:
                self._parked.admit(current, number, sender, None, (key[1], detail or reason))
                return
            handled = self._admit(sender, None)
            self._tell_refused(sender, number, key[1], detail or reason)
        self._credit(handled, number)

    # ---------------------------------------------------------------- agreement
    def _on_done(self, topic: str, envelope: Envelope) -> None:
        batches = envelope.meta.get("batches")
        if isinstance(batches, bool) or not isinstance(batches, int) or batches < 0:
            self.stats.rejected["done"] += 1
            return
        sender = sender_of(topic)
        with self._lock:
            if envelope.round > self._ledger.number:  # remembered with its try
                self._early.remember(
                    ("done", envelope.round, sender), (batches, envelope_attempt(envelope))
                )
                return
            if envelope.round < self._ledger.number or envelope_attempt(envelope) < self._attempt:
                return
            if not self._ledger.declare(sender, batches):
                return
            self._progress[sender] = time.monotonic()
            handled = self._drain()  # ordered: the next sender's turn may begin
        if self._ledger.peers:
            self._publish_counts()
        self._credit(handled, envelope.round)
        self._settle()

    def _on_counts(self, topic: str, envelope: Envelope) -> None:
        raw = envelope.meta.get("counts")
        if not isinstance(raw, dict) or not all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool) and v >= 0
            for k, v in raw.items()
        ):
            self.stats.rejected["counts"] += 1
            return
        peer = sender_of(topic)
        if peer == self.name:
            return
        with self._lock:
            if envelope.round > self._ledger.number:
                self._early.remember(("counts", envelope.round, peer), dict(raw))
                return
            if envelope.round < self._ledger.number:
                return
            if not self._ledger.peer_counts(peer, raw):
                return
        self._settle()

    def _apply_early(self, number: int) -> None:
        for what, who, value in self._early.take(number):
            if what == "counts":
                self._ledger.peer_counts(who, value)
            elif value[1] == self._attempt:  # a done of a try given up early ends no retry's
                self._ledger.declare(who, value[0])  # part: (batches, try)

    def _after_count(self, sender: str) -> None:
        """Peers learn the new count once ``sender`` has said what it sent (before that,
        no server can finish it, and each batch would cost a message)."""
        if self._ledger.peers and sender in self._ledger.declared:
            self._publish_counts()
        self._settle()

    def _publish_counts(self) -> None:
        with self._lock:
            counts, number = self._ledger.own_counts, self._ledger.number
        self.channel.send(
            topics.processed(self.run, self.name),
            "round_control",
            self.run,
            round=number,
            meta={"counts": counts},
        )

    def _settle(self) -> None:
        with self._changed:
            was = self._ledger.complete
            if not self._ledger.settle():
                return
            self._changed.notify_all()
            completed = not was and self._ledger.complete
            number = self._ledger.number
        if completed and self.on_complete is not None:
            self.on_complete(number)
