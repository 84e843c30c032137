"""Envelopes over a transport: encoding, chunking, exactly-once processing, validation.

Each sender numbers its messages per stream (``seq``) under an ``epoch`` chosen at start, so a
restarted sender begins a new stream. A receiver remembers recent sequence numbers per
(sender, epoch, kind) and drops redelivered duplicates, turning MQTT's at-least-once delivery
into exactly-once processing. Every inbound payload is validated; a bad one is counted under
its reason, logged, and dropped without reaching the handler; a subscriber that must account
for it (a GPU server returns the credit a rejected batch cost) gets a :class:`Rejection`.
"""

from __future__ import annotations

import collections
import itertools
import logging
import re
import threading
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from wire.chunks import Reassembler, is_chunk, split
from wire.codec import MAX_MESSAGE_BYTES, Envelope, TensorSpec, decode, encode, read_header
from wire.errors import WireError
from wire.logs import warn
from wire.recent import recent_entry
from wire.transport import Transport

__all__ = ["Channel", "ChannelStats", "Rejection"]

log = logging.getLogger(__name__)
DEFAULT_CHUNK_BYTES = 32 * 1024 * 1024  # below the broker's max_packet_size (80 MiB)
_WINDOW = 1 << 16
# streams (topic, sender, epoch, kind) whose sequence numbers a channel remembers: two per
# sender of 10,000 clients over a broker fit
_STREAMS = 1 << 16
_EPOCH = re.compile(r"[0-9a-f]{1,32}")  # Channel.epoch: 16
_FRAME_HEADROOM = 512  # chunk frame header (~150 bytes) with room to spare
_MIN_CHUNK = 1024
_SOURCES = 1024  # senders whose incomplete messages a receiver keeps apart


@dataclass
class ChannelStats:
    sent: int = 0
    received: int = 0
    duplicates: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    rejected: collections.Counter[str] = field(default_factory=collections.Counter)
    # bytes by envelope kind ("activations", "gradients", "credit", ...)
    sent_by_kind: collections.Counter[str] = field(default_factory=collections.Counter)
    received_by_kind: collections.Counter[str] = field(default_factory=collections.Counter)


@dataclass(frozen=True)
class Rejection:
    """A message that failed validation: where it came (the topic, which the broker's ACL
    binds to the publishing device), why, and what its header claims where it could still be
    read (``header``: ``kind``, ``run``, ``sender``, ``seq``, ``round``, ``epoch``, each only
    when present with the right type; empty when the framing was broken)."""

    topic: str
    reason: str
    detail: str
    header: Mapping[str, Any] = field(default_factory=dict)


class _Seen:
    """Recent sequence numbers of one stream; anything older than the window counts as seen."""

    def __init__(self) -> None:
        self.highest = -1
        self.recent: set[int] = set()

    def first_time(self, seq: int) -> bool:
        if seq <= self.highest - _WINDOW or seq in self.recent:
            return False
        self.recent.add(seq)
        if seq > self.highest:
            self.highest = seq
            if len(self.recent) > 2 * _WINDOW:
                self.recent = {s for s in self.recent if s > self.highest - _WINDOW}
        return True


class Channel:
    """Sends and receives :class:`Envelope` messages for one participant (``sender``)."""

    def __init__(
        self,
        transport: Transport,
        sender: str,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        max_message_bytes: int = MAX_MESSAGE_BYTES,
        reassembly_timeout: float = 120.0,
    ) -> None:
        self.transport, self.sender = transport, sender
        self.chunk_bytes = min(chunk_bytes, transport.max_payload - _FRAME_HEADROOM)
        if self.chunk_bytes < _MIN_CHUNK:
            raise ValueError(
                f"the transport's max_payload ({transport.max_payload} bytes) leaves chunks of "
                f"{self.chunk_bytes} bytes; it must allow at least {_MIN_CHUNK + _FRAME_HEADROOM}"
            )
        self.max_message_bytes = max_message_bytes
        self.epoch = uuid.uuid4().hex[:16]
        self.stats = ChannelStats()
        self._counters: dict[str, itertools.count[int]] = {}
        # by the hash of (topic, sender, epoch, kind): a fixed size whatever a sender writes
        self._seen: collections.OrderedDict[int, _Seen] = collections.OrderedDict()
        self._reassembly_timeout = reassembly_timeout
        # one reassembler per topic (per sender, under the ACL): what one sender leaves
        # incomplete cannot crowd out another's chunked messages
        self._reassemblers: collections.OrderedDict[str, Reassembler] = collections.OrderedDict()
        self._lock = threading.Lock()

    def send(
        self,
        topic: str,
        kind: str,
        run: str,
        *,
        round: int = 0,
        tensors: Mapping[str, np.ndarray] | None = None,
        meta: Mapping[str, Any] | None = None,
        encoding: str = "fp32",
        retain: bool = False,
    ) -> int:
        """Encode and publish one envelope (chunked if large); return its sequence number."""
        with self._lock:
            seq = next(self._counters.setdefault(kind, itertools.count()))
        envelope = Envelope(
            kind,
            run,
            self.sender,
            seq,
            round,
            {**(meta or {}), "epoch": self.epoch},
            dict(tensors or {}),
        )
        data = encode(envelope, encoding)
        if len(data) > self.max_message_bytes:
            raise ValueError(
                f"message of {len(data)} bytes exceeds max_message_bytes {self.max_message_bytes}"
            )
        if len(data) <= self.chunk_bytes:
            self.transport.publish(topic, data, retain)
        else:
            for frame in split(data, self.chunk_bytes):
                self.transport.publish(topic, frame)
        with self._lock:
            self.stats.sent += 1
            self.stats.bytes_sent += len(data)
            self.stats.sent_by_kind[kind] += len(data)
        return seq

    def subscribe(
        self,
        topic_filter: str,
        handler: Callable[[Envelope], None],
        expect: Mapping[str, TensorSpec] | None = None,
        kinds: frozenset[str] | None = None,
    ) -> None:
        """Deliver each valid, first-seen envelope on ``topic_filter`` to ``handler``."""
        self.listen(topic_filter, lambda _topic, envelope: handler(envelope), expect, kinds)

    def listen(
        self,
        topic_filter: str,
        handler: Callable[[str, Envelope], None],
        expect: Mapping[str, TensorSpec] | None = None,
        kinds: frozenset[str] | None = None,
        on_reject: Callable[[Rejection], None] | None = None,
    ) -> None:
        """Deliver each valid, first-seen envelope on ``topic_filter`` to ``handler`` with
        the topic it came on; each rejected one (counted and logged) to ``on_reject``."""

        def receive(topic: str, payload: bytes) -> None:
            whole: bytes | None = None
            try:
                whole = self._reassemble(topic, payload)
                envelope = None if whole is None else self._accept(topic, whole, expect, kinds)
            except WireError as error:
                self.stats.rejected[error.reason] += 1
                warn(log, (topic, error.reason), "rejected message on %s: %s", topic, error)
                if on_reject is not None:
                    header = {} if whole is None else read_header(whole)
                    on_reject(Rejection(topic, error.reason, str(error), header))
                return
            if envelope is not None:
                handler(topic, envelope)

        self.transport.subscribe(topic_filter, receive)

    def _reassemble(self, topic: str, payload: bytes) -> bytes | None:
        """The whole message: ``payload`` itself, or once its last chunk came (else None)."""
        if not is_chunk(payload):
            return payload
        with self._lock:
            reassembler = recent_entry(self._reassemblers, topic, self._new_reassembler, _SOURCES)
            return reassembler.feed(payload)

    def _new_reassembler(self) -> Reassembler:
        return Reassembler(self.max_message_bytes, self._reassembly_timeout)

    def _accept(
        self,
        topic: str,
        payload: bytes,
        expect: Mapping[str, TensorSpec] | None,
        kinds: frozenset[str] | None,
    ) -> Envelope | None:
        envelope = decode(payload, expect, self.max_message_bytes)
        if kinds is not None and envelope.kind not in kinds:
            raise WireError("kind", f"{envelope.kind!r} is not accepted here")
        epoch = envelope.meta.get("epoch")
        if not isinstance(epoch, str):
            raise WireError("header", "meta.epoch is missing")
        if not _EPOCH.fullmatch(epoch):  # each new one would be remembered
            raise WireError("header", f"meta.epoch: expected 1-32 hex digits, got {epoch[:40]!r}")
        # by topic too: an envelope's sender is what the payload says, the topic is the
        # account's (ACL), so a forged sender cannot mark another's batches as seen
        key = hash((topic, envelope.sender, epoch, envelope.kind))
        with self._lock:
            # the least recently heard of more than _STREAMS is forgotten: a sender minting
            # epochs or names cannot grow this
            first = recent_entry(self._seen, key, _Seen, _STREAMS).first_time(envelope.seq)
            if not first:
                self.stats.duplicates += 1
                return None
            self.stats.received += 1
            self.stats.bytes_received += len(payload)
            self.stats.received_by_kind[envelope.kind] += len(payload)
        meta = {k: v for k, v in envelope.meta.items() if k != "epoch"}
        # built anew, not with dataclasses.replace (about 6 us more): this runs for every message
        head = (envelope.kind, envelope.run, envelope.sender, envelope.seq, envelope.round)
        return Envelope(*head, meta, envelope.tensors)
