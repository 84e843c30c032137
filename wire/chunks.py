"""Chunking of payloads above the broker's packet limit, and bounded reassembly.

Frame: ``b"ESC1"``, header length (uint32 LE), JSON ``{"id", "index", "count", "total",
"sha256"}``, then the chunk's bytes. The reassembler keeps at most ``max_pending_bytes`` of
incomplete messages, drops a message whose chunks stop arriving for ``timeout`` seconds, and
checks the SHA-256 of the whole before handing it on.
"""

from __future__ import annotations

import collections
import hashlib
import json
import re
import struct
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from wire.errors import WireError

__all__ = ["CHUNK_MAGIC", "Reassembler", "is_chunk", "split"]

CHUNK_MAGIC = b"ESC1"
_LENGTH = struct.Struct("<I")
_MAX_CHUNKS = 1 << 20
_MAX_HEADER = 512  # split's headers are about 150 bytes
# what a held chunk costs beyond its bytes (its header's fields, a dict entry, a bytes
# object): counted against the bound, so a million 1-byte chunks are not "1 MB"
CHUNK_OVERHEAD = 128
_HEX64 = re.compile(r"[0-9a-f]{64}")


def is_chunk(data: bytes) -> bool:
    return data[: len(CHUNK_MAGIC)] == CHUNK_MAGIC


def split(data: bytes, chunk_bytes: int) -> Iterator[bytes]:
    """Frames of at most ``chunk_bytes`` payload each (plus a small header)."""
    if chunk_bytes < 1024:
        raise ValueError(f"chunk_bytes: must be >= 1024, got {chunk_bytes}")
    count = max(1, -(-len(data) // chunk_bytes))
    identity = uuid.uuid4().hex
    digest = hashlib.sha256(data).hexdigest()
    view = memoryview(data)
    for index in range(count):
        header = json.dumps(
            {"id": identity, "index": index, "count": count, "total": len(data), "sha256": digest}
        ).encode()
        body = view[index * chunk_bytes : (index + 1) * chunk_bytes]
        yield CHUNK_MAGIC + _LENGTH.pack(len(header)) + header + bytes(body)


@dataclass
class _Pending:
    count: int
    total: int
    sha256: str
    parts: dict[int, bytes] = field(default_factory=dict)
    size: int = 0
    last_seen: float = 0.0


def _check_geometry(index: int, count: int, total: int, size: int) -> None:
    """A message's first chunk must fit its declared size and count: every chunk but the last
    is full, so a chunk of ``size`` bytes means ``ceil(total / size)`` chunks."""
    if count == 1 and size != total:
        raise WireError("header", f"a single chunk of {size} bytes declares {total}")
    if index < count - 1 and (size == 0 or -(-total // size) != count):
        raise WireError(
            "header", f"{count} chunks of {size} bytes cannot make the declared {total} bytes"
        )


class Reassembler:
    """Collects chunks per message id; ``feed`` returns the whole message when complete."""

    def __init__(
        self,
        max_pending_bytes: int = 1 << 30,
        timeout: float = 120.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_pending_bytes, self.timeout, self.clock = max_pending_bytes, timeout, clock
        # by when each was last heard, oldest first: expiry looks at the front only
        self._pending: collections.OrderedDict[str, _Pending] = collections.OrderedDict()
        self.expired = 0
        self._held = 0  # pending_bytes, kept as chunks come and go (a sum each time was O(n^2))

    @property
    def pending_bytes(self) -> int:
        """Bytes held by incomplete messages: what arrived of them, not what they declare
        (a frame declaring a huge total must not reserve the bound for itself), and
        :data:`CHUNK_OVERHEAD` for each chunk."""
        return self._held

    def _drop(self, identity: str) -> None:
        pending = self._pending.pop(identity)
        self._held -= pending.size + CHUNK_OVERHEAD * len(pending.parts)

    def _parse(self, data: bytes) -> tuple[dict[str, object], bytes]:
        start = len(CHUNK_MAGIC) + _LENGTH.size
        if len(data) < start or not is_chunk(data):
            raise WireError("framing", "not a chunk frame")
        (length,) = _LENGTH.unpack_from(data, len(CHUNK_MAGIC))
        if start + length > len(data):
            raise WireError("framing", "chunk header longer than the frame")
        if length > _MAX_HEADER:
            raise WireError("framing", f"chunk header of {length} bytes, at most {_MAX_HEADER}")
        try:
            header = json.loads(data[start : start + length])
        except (ValueError, RecursionError) as error:  # as in wire.codec._header
            raise WireError("header", f"chunk header is not JSON: {error}") from error
        fields = {"id": str, "index": int, "count": int, "total": int, "sha256": str}
        if not isinstance(header, dict) or any(
            not isinstance(header.get(k), t) for k, t in fields.items()
        ):
            raise WireError("header", "chunk header misses id/index/count/total/sha256")
        if not 0 <= header["index"] < header["count"] <= _MAX_CHUNKS or header["total"] < 0:
            raise WireError("header", "chunk index/count out of range")
        if len(header["id"]) > 64 or not _HEX64.fullmatch(header["sha256"]):
            raise WireError("header", "chunk id over 64 characters, or sha256 not 64 hex digits")
        return header, data[start + length :]

    def _expire(self, now: float) -> None:
        while self._pending:
            identity, pending = next(iter(self._pending.items()))
            if now - pending.last_seen <= self.timeout:
                return
            self._drop(identity)
            self.expired += 1

    def feed(self, data: bytes) -> bytes | None:
        header, body = self._parse(data)
        now = self.clock()
        self._expire(now)
        identity = str(header["id"])
        pending = self._pending.get(identity)
        if pending is None:
            total, count = int(header["total"]), int(header["count"])  # type: ignore[call-overload]
            if total > self.max_pending_bytes:
                raise WireError(
                    "oversize",
                    f"message of {total} bytes exceeds the reassembly bound of "
                    f"{self.max_pending_bytes}",
                )
            _check_geometry(int(header["index"]), count, total, len(body))  # type: ignore[call-overload]
            pending = _Pending(count, total, str(header["sha256"]))
            self._pending[identity] = pending
        # the chunks' overhead on top: a message of the bound's size in 32 MiB chunks still fits
        if self._held + len(body) + CHUNK_OVERHEAD > self.max_pending_bytes * 65 // 64:
            self._drop(identity)
            raise WireError(
                "oversize",
                f"incomplete messages would hold more than {self.max_pending_bytes} bytes",
            )
        if (pending.count, pending.total) != (header["count"], header["total"]):
            raise WireError("header", "chunk disagrees with earlier chunks of its message")
        index = int(header["index"])  # type: ignore[call-overload]
        if index not in pending.parts:
            if pending.size + len(body) > pending.total:
                self._drop(identity)
                raise WireError("oversize", "chunks exceed the declared total size")
            pending.parts[index] = body
            pending.size += len(body)
            self._held += len(body) + CHUNK_OVERHEAD
        pending.last_seen = now
        self._pending.move_to_end(identity)
        if len(pending.parts) < pending.count:
            return None
        self._drop(identity)
        whole = b"".join(pending.parts[i] for i in range(pending.count))
        if len(whole) != pending.total or hashlib.sha256(whole).hexdigest() != pending.sha256:
            raise WireError("payload", "reassembled message does not match its size or hash")
        return whole
