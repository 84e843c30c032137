"""Envelope codec and chunking: round trips, and rejection of every kind of bad input."""

from __future__ import annotations

import json
import os
import random
import struct

import numpy as np
import pytest

from wire.chunks import CHUNK_OVERHEAD, Reassembler, split
from wire.codec import ENCODINGS, Envelope, TensorSpec, decode, encode
from wire.errors import WireError

pytestmark = pytest.mark.unit

RNG = np.random.default_rng(0)
X = RNG.standard_normal((8, 16, 4, 4)).astype(np.float32)
Y = np.arange(8, dtype=np.int64)
EXPECT = {"x": TensorSpec("float32", (None, 16, 4, 4)), "y": TensorSpec("int64", (None,))}
TOLERANCE = {"fp32": 0.0, "fp16": 2e-3, "bf16": 2e-2, "int8": 0.03}


def envelope(**changes: object) -> Envelope:
    fields: dict[str, object] = {
        "kind": "activations",
        "run": "demo-1",
        "sender": "pi-01",
        "seq": 5,
        "round": 2,
        "meta": {"epoch": "e1"},
        "tensors": {"x": X, "y": Y},
    }
    fields.update(changes)
    return Envelope(**fields)  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_round_trip_restores_dtype_and_values(encoding: str) -> None:
    data = encode(envelope(), encoding)
    back = decode(data, EXPECT)
    assert (back.kind, back.run, back.sender, back.seq, back.round) == (
        "activations",
        "demo-1",
        "pi-01",
        5,
        2,
    )
    assert back.tensors["x"].dtype == np.float32 and np.array_equal(back.tensors["y"], Y)
    assert np.max(np.abs(back.tensors["x"] - X)) <= TOLERANCE[encoding] * np.max(np.abs(X))


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_channels_last_activations_keep_their_logical_order(encoding: str) -> None:
    # conv outputs are often channels-last in memory; the wire carries the logical order
    channels_last = np.ascontiguousarray(X.transpose(0, 2, 3, 1)).transpose(0, 3, 1, 2)
    assert not channels_last.flags["C_CONTIGUOUS"]
    back = decode(encode(envelope(tensors={"x": channels_last, "y": Y}), encoding), EXPECT)
    assert np.max(np.abs(back.tensors["x"] - X)) <= TOLERANCE[encoding] * np.max(np.abs(X))


def test_compression_shrinks_the_payload() -> None:
    sizes = {e: len(encode(envelope(tensors={"x": X}), e)) for e in ENCODINGS}
    assert sizes["fp16"] < 0.55 * sizes["fp32"] and sizes["int8"] < 0.3 * sizes["fp32"]


def _raw(header: dict[str, object], payload: bytes = b"") -> bytes:
    body = json.dumps(header).encode()
    return b"ESW1" + struct.pack("<I", len(body)) + body + payload


GOOD_HEADER = {
    "kind": "round_control",
    "run": "r",
    "sender": "s",
    "seq": 0,
    "round": 0,
    "meta": {},
    "tensors": {},
}


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (encode(envelope())[:-10], "payload"),  # truncated tensor bytes
        (encode(envelope())[:6], "framing"),  # truncated header
        (b"GARBAGE!" * 4, "framing"),
        (b"ESW1" + struct.pack("<I", 5) + b"{oops", "header"),
        (_raw({**GOOD_HEADER, "kind": "launch_missiles"}), "kind"),
        (_raw({**GOOD_HEADER, "kind": "assignment"}), "kind"),  # rides on Flower, not here
        (_raw({**GOOD_HEADER, "seq": -1}), "header"),
        (_raw({**GOOD_HEADER, "extra": 1}), "header"),
        (_raw({k: v for k, v in GOOD_HEADER.items() if k != "run"}), "header"),
        (_raw(GOOD_HEADER, b"trailing"), "payload"),
    ],
)
def test_malformed_messages_are_rejected_with_a_reason(data: bytes, reason: str) -> None:
    with pytest.raises(WireError) as caught:
        decode(data)
    assert caught.value.reason == reason


def test_wrong_shape_dtype_and_names_against_expectation() -> None:
    data = encode(envelope())
    with pytest.raises(WireError, match="shape") as caught:
        decode(data, {**EXPECT, "x": TensorSpec("float32", (None, 8, 4, 4))})
    assert caught.value.reason == "shape"
    with pytest.raises(WireError) as caught:
        decode(data, {**EXPECT, "y": TensorSpec("int32", (None,))})
    assert caught.value.reason == "dtype"
    with pytest.raises(WireError) as caught:
        decode(data, {"x": EXPECT["x"]})
    assert caught.value.reason == "payload"


@pytest.mark.parametrize("encoding", ["fp32", "fp16"])
def test_nan_and_inf_are_rejected(encoding: str) -> None:
    bad = X.copy()
    bad[0, 0, 0, 0] = np.nan
    with pytest.raises(WireError) as caught:
        decode(encode(envelope(tensors={"x": bad}), encoding))
    assert caught.value.reason == "non_finite"
    bad[0, 0, 0, 0] = np.inf
    with pytest.raises(WireError):
        decode(encode(envelope(tensors={"x": bad}), encoding))


def test_oversize_is_rejected_before_parsing() -> None:
    data = encode(envelope())
    with pytest.raises(WireError) as caught:
        decode(data, max_bytes=len(data) - 1)
    assert caught.value.reason == "oversize"


def test_encode_refuses_unknown_kind_and_encoding() -> None:
    with pytest.raises(ValueError, match="kind"):
        encode(envelope(kind="nope"))
    with pytest.raises(ValueError, match="encoding"):
        encode(envelope(), "fp8")


def test_chunks_reassemble_in_any_order_exactly_once() -> None:
    data = os.urandom(5 * 1024 * 1024 + 17)
    frames = list(split(data, 1024 * 1024))
    random.Random(1).shuffle(frames)
    frames.insert(3, frames[0])  # a redelivered chunk
    reassembler = Reassembler()
    results = [r for r in (reassembler.feed(f) for f in frames) if r is not None]
    assert results == [data] and reassembler.pending_bytes == 0


def test_reassembly_times_out_and_bounds_memory() -> None:
    now = [0.0]
    reassembler = Reassembler(max_pending_bytes=3 * 1024 * 1024, timeout=10, clock=lambda: now[0])
    first = list(split(os.urandom(2 * 1024 * 1024), 1024 * 1024))
    assert reassembler.feed(first[0]) is None
    second = list(split(os.urandom(3 * 1024 * 1024), 1024 * 1024))
    assert reassembler.feed(second[0]) is None
    assert reassembler.feed(second[1]) is None  # 3 MiB held: the bound
    with pytest.raises(WireError) as caught:  # what arrives beyond it is refused
        reassembler.feed(second[2])
    assert caught.value.reason == "oversize"
    now[0] = 11.0  # the first message's chunks stopped arriving
    assert reassembler.feed(next(split(b"x" * 2048, 1024))) is None
    assert reassembler.expired == 1


def test_a_small_frame_declaring_a_huge_message_reserves_nothing() -> None:
    import hashlib
    import json
    import struct

    def frame(index: int, count: int, total: int, body: bytes) -> bytes:
        header = json.dumps(
            {"id": "x", "index": index, "count": count, "total": total, "sha256": "0" * 64}
        ).encode()
        return b"ESC1" + struct.pack("<I", len(header)) + header + body

    reassembler = Reassembler(max_pending_bytes=1 << 30)
    with pytest.raises(WireError, match="single chunk"):  # 100 bytes said to be 1 GiB
        reassembler.feed(frame(0, 1, 1 << 30, b"x" * 100))
    with pytest.raises(WireError, match="cannot make"):
        reassembler.feed(frame(0, 3, 1 << 30, b"x" * 100))
    assert reassembler.feed(frame(2, 3, 1 << 29, b"x" * 100)) is None  # a last chunk first
    assert reassembler.pending_bytes == 100 + CHUNK_OVERHEAD  # what came, nothing more
    data = os.urandom(4096)
    (whole,) = [r for r in (reassembler.feed(f) for f in split(data, 1024)) if r is not None]
    assert whole == data and hashlib.sha256(whole).digest()


def _frame(header: dict[str, object], body: bytes = b"x") -> bytes:
    import json
    import struct

    encoded = json.dumps(header).encode()
    return b"ESC1" + struct.pack("<I", len(encoded)) + encoded + body


def test_tiny_chunks_count_what_holding_them_costs_and_headers_are_bounded() -> None:
    reassembler = Reassembler(max_pending_bytes=1 << 20)
    fits = 0
    with pytest.raises(WireError, match="incomplete messages would hold more"):
        for number in range(100_000):  # 1-byte last chunks, each of its own message
            header = {"id": f"{number:x}", "index": 1, "count": 2, "total": 2000}
            reassembler.feed(_frame({**header, "sha256": "0" * 64}))
            fits += 1
    assert fits == (1 << 20) * 65 // 64 // (1 + CHUNK_OVERHEAD)  # not a million "bytes"
    assert reassembler.pending_bytes == fits * (1 + CHUNK_OVERHEAD)

    fresh = Reassembler()
    header = {"id": "a", "index": 1, "count": 2, "total": 2000}
    with pytest.raises(WireError, match="chunk header of 1000064 bytes"):
        fresh.feed(_frame({**header, "sha256": "f" * 1_000_000}, b""))  # held, not counted
    with pytest.raises(WireError, match="sha256 not 64 hex"):
        fresh.feed(_frame({**header, "sha256": "z" * 64}))
    with pytest.raises(WireError, match="chunk id over 64"):
        fresh.feed(_frame({**header, "id": "i" * 65, "sha256": "0" * 64}))
    assert fresh.pending_bytes == 0


def test_corrupted_chunk_is_detected() -> None:
    frames = list(split(os.urandom(4096), 1024))
    frames[1] = frames[1][:-1] + bytes([frames[1][-1] ^ 0xFF])
    reassembler = Reassembler()
    with pytest.raises(WireError, match="hash"):
        for frame in frames:
            reassembler.feed(frame)
