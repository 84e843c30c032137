"""What a :class:`~wire.stream.StreamServer` keeps of its senders' batches: the counts it
reports, batches parked for a round it has not begun, and what it reads off an envelope."""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

from wire.codec import Envelope

__all__ = ["Parked", "StreamStats", "envelope_attempt", "sender_of"]


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


def sender_of(topic: str) -> str:
    return topic.rsplit("/", 1)[-1]


def envelope_attempt(envelope: Envelope) -> int:
    """The coordinator's try an envelope says it belongs to (1 when it says none)."""
    value = envelope.meta.get("attempt", 1)
    return value if isinstance(value, int) and not isinstance(value, bool) else 1
