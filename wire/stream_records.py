"""What a :class:`~wire.stream.StreamServer` keeps of its senders' batches: the counts it
reports, batches parked and messages kept for a round it has not begun, and what it reads
off an envelope."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from wire.codec import Envelope

__all__ = [
    "EarlyNotes",
    "Parked",
    "ParkingLot",
    "StreamStats",
    "envelope_attempt",
    "sender_of",
]


@dataclass
class StreamStats:
    """Batches handled per sender, rejections by reason, rounds each sender left offline."""

    handled: collections.Counter[str] = field(default_factory=collections.Counter)
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    left: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class Parked:
    number: int
    sender: str
    envelope: Envelope | None  # None: a rejected batch, counted when the round begins
    refusal: tuple[int, str] | None = None  # a rejected batch's sequence number and why


def sender_of(topic: str) -> str:
    return topic.rsplit("/", 1)[-1]


def envelope_attempt(envelope: Envelope) -> int:
    """The coordinator's try an envelope says it belongs to (1 when it says none)."""
    value = envelope.meta.get("attempt", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


class EarlyNotes:
    """What a peer or sender said of a round not begun here yet, keyed ``(what, round, who)``:
    bounded in all (``most``) and per ``who`` (``each``), a newer value replacing an older."""

    def __init__(self, most: int, each: int) -> None:
        self.most, self.each = most, each
        self._notes: dict[tuple[str, int, str], Any] = {}
        self._by: collections.Counter[str] = collections.Counter()

    def remember(self, key: tuple[str, int, str], value: Any) -> None:
        if key in self._notes:
            self._notes[key] = value
        elif len(self._notes) < self.most and self._by[key[2]] < self.each:
            self._notes[key] = value
            self._by[key[2]] += 1

    def take(self, number: int) -> list[tuple[str, str, Any]]:
        """Round ``number``'s notes as ``(what, who, value)``, forgetting every note of a
        round up to it."""
        notes = [(what, who, v) for (what, r, who), v in self._notes.items() if r == number]
        self._notes = {k: v for k, v in self._notes.items() if k[1] > number}
        self._by = collections.Counter(k[2] for k in self._notes)
        return notes


class ParkingLot:
    """Batches (and rejections) of a round a server has not begun yet, which a peer began
    first. A few per sender and bytes per sender, within totals, so one sender crowds out no
    other; and once this server has begun a round, only for the round after it: a batch for
    a round far ahead is no peer's. (Any round ahead was parked, each up to the largest
    message, and held until the run ended: a device grew a GPU server by gigabytes.)"""

    def __init__(self, most: int, per_sender: int, bytes_most: int = 1 << 30) -> None:
        self.most, self.per_sender, self.bytes_most = most, per_sender, bytes_most
        self._parked: list[Parked] = []
        self._bytes: collections.Counter[str] = collections.Counter()

    def admit(
        self,
        begun: int,
        number: int,
        sender: str,
        envelope: Envelope | None,
        refusal: tuple[int, str] | None = None,
    ) -> bool:
        """Park ``sender``'s batch of round ``number`` (None: rejected, with ``refusal``; this
        server's round is ``begun``, 0 before its first); whether it was."""
        parked = Parked(number, sender, envelope, refusal)
        if begun and parked.number != begun + 1:
            return False
        size = _size(parked)
        mine = sum(1 for p in self._parked if p.sender == parked.sender)
        if len(self._parked) >= self.most or mine >= self.per_sender:
            return False
        if self._bytes[parked.sender] + size > self.bytes_most // 4:  # a quarter each at most
            return False
        if sum(self._bytes.values()) + size > self.bytes_most:
            return False
        self._parked.append(parked)
        self._bytes[parked.sender] += size
        return True

    def take(self, number: int) -> list[Parked]:
        """What waited for round ``number``; earlier rounds' are dropped, later ones kept."""
        ready = [p for p in self._parked if p.number == number]
        self._parked = [p for p in self._parked if p.number > number]
        self._bytes = collections.Counter()
        for kept in self._parked:
            self._bytes[kept.sender] += _size(kept)
        return ready

    def clear(self) -> None:
        self._parked, self._bytes = [], collections.Counter()

    def __len__(self) -> int:
        return len(self._parked)


def _size(parked: Parked) -> int:
    envelope = parked.envelope
    return 0 if envelope is None else sum(a.nbytes for a in envelope.tensors.values())
