"""Bundles: several small payloads to one topic carried as one MQTT message.

A sender faster than its broker link would otherwise pay the broker's and paho's per-message
work (framing, acknowledgement, routing, a callback) for each small activation batch. While its
earlier messages wait for their acknowledgements, the MQTT transport holds small payloads back
and sends those to the same topic together as one bundle; a receiving transport hands each
part to its handlers as if it had come alone, so everything above the transport (the
Channel's validation, duplicates, credits) is unchanged. A lone message, or one sent while the
link keeps up, goes out on its own at once.

Frame: ``b"ESB1"``, the part count (uint32 LE), each part's length (uint32 LE), then the parts
back to back. A receiver checks the frame before splitting it (count within bounds, lengths
that add up to exactly the rest of the message, no empty part) and drops a broken one whole;
the parts it yields are then validated one by one like any message.
"""

from __future__ import annotations

import collections
import logging
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from wire.errors import WireError
from wire.logs import warn

__all__ = [
    "BUNDLE_MAGIC",
    "MAX_PARTS",
    "Held",
    "bundle",
    "holdable",
    "is_bundle",
    "parts_of",
    "unbundle",
]

BUNDLE_MAGIC = b"ESB1"
MAX_PARTS = 4096
_COUNT = struct.Struct("<I")


def is_bundle(data: bytes) -> bool:
    return data[: len(BUNDLE_MAGIC)] == BUNDLE_MAGIC


def holdable(topic: str, payload: bytes, retain: bool, bundle_bytes: int) -> bool:
    """Whether a transport may hold ``payload`` back for a bundle: small, not empty, not
    retained, and to a topic paho will take (a bad one must fail the caller's publish at once,
    not the network thread's later)."""
    if retain or not 0 < len(payload) <= bundle_bytes // 4:
        return False
    try:
        name = topic.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return 0 < len(name) <= 65535 and b"+" not in name and b"#" not in name


def bundle(parts: Sequence[bytes]) -> bytes:
    """One frame holding ``parts`` in order."""
    if not 1 <= len(parts) <= MAX_PARTS:
        raise ValueError(f"a bundle holds 1 to {MAX_PARTS} parts, got {len(parts)}")
    if any(not part for part in parts):
        raise ValueError("a bundle cannot hold an empty part")
    lengths = struct.pack(f"<{len(parts)}I", *(len(part) for part in parts))
    return b"".join((BUNDLE_MAGIC, _COUNT.pack(len(parts)), lengths, *parts))


def unbundle(data: bytes) -> list[bytes]:
    """The parts of bundle ``data``; :class:`WireError` (reason ``bundle``) when the frame is
    broken, so that none of it is delivered."""
    start = len(BUNDLE_MAGIC) + _COUNT.size
    if len(data) < start or not is_bundle(data):
        raise WireError("bundle", "not a bundle (bad magic or truncated)")
    (count,) = _COUNT.unpack_from(data, len(BUNDLE_MAGIC))
    if not 1 <= count <= MAX_PARTS:
        raise WireError("bundle", f"part count {count} outside 1..{MAX_PARTS}")
    body = start + 4 * count
    if len(data) < body:
        raise WireError("bundle", f"{count} parts announced, the frame ends in their lengths")
    lengths = struct.unpack_from(f"<{count}I", data, start)
    if 0 in lengths:
        raise WireError("bundle", "a part of length 0")
    if sum(lengths) != len(data) - body:
        raise WireError(
            "bundle", f"parts of {sum(lengths)} bytes announced, {len(data) - body} present"
        )
    parts, offset = [], body
    for length in lengths:
        parts.append(data[offset : offset + length])
        offset += length
    return parts


def parts_of(topic: str, payload: bytes, log: logging.Logger) -> list[bytes]:
    """What a received ``payload`` carries: itself, or a bundle's parts; none for a broken
    bundle, which is logged to ``log`` (rate-limited) and must be counted by the caller."""
    if not is_bundle(payload):
        return [payload]
    try:
        return unbundle(payload)
    except WireError as error:
        warn(log, (topic, "bundle"), "dropped a broken bundle on %s: %s", topic, error)
        return []


@dataclass
class _Run:
    topic: str
    parts: list[bytes] = field(default_factory=list)
    size: int = 0


class Held:
    """Payloads held back, in publishing order, as runs of consecutive ones to one topic;
    each run is at most ``bundle_bytes`` (so a bundle stays far below the broker's limit)."""

    def __init__(self, bundle_bytes: int) -> None:
        self.bundle_bytes = bundle_bytes
        self.bytes = 0
        self._runs: collections.deque[_Run] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._runs)

    def add(self, topic: str, payload: bytes) -> None:
        last = self._runs[-1] if self._runs else None
        if (
            last is None
            or last.topic != topic
            or last.size + len(payload) > self.bundle_bytes
            or len(last.parts) >= MAX_PARTS
        ):
            last = _Run(topic)
            self._runs.append(last)
        last.parts.append(payload)
        last.size += len(payload)
        self.bytes += len(payload)

    def take(self) -> tuple[str, list[bytes]]:
        """The oldest run's topic and parts (removed)."""
        run = self._runs.popleft()
        self.bytes -= run.size
        return run.topic, run.parts

    def put_back(self, topic: str, parts: list[bytes]) -> None:
        """Return a run :meth:`take` gave that could not be sent, to go first next time."""
        size = sum(len(part) for part in parts)
        self._runs.appendleft(_Run(topic, parts, size))
        self.bytes += size

    def clear(self) -> int:
        """Drop everything held; the number of payloads dropped."""
        dropped = sum(len(run.parts) for run in self._runs)
        self._runs.clear()
        self.bytes = 0
        return dropped
