"""What a :class:`~wire.stream.StreamServer` keeps of its senders' batches: the counts it
reports, batches parked and messages kept for a round it has not begun, and what it reads
off an envelope."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field
from typing import Any

from wire.codec import Envelope

__all__ = ["EarlyNotes", "Parked", "StreamStats", "envelope_attempt", "sender_of"]


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
