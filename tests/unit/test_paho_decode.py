"""The one-copy PUBLISH decoder (``wire.paho_decode``) gives what paho's own gives, refuses
what it does not handle to paho, and is used by edgesplit's clients only."""

from __future__ import annotations

import collections
import random
import struct
from typing import Any

import pytest
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTProtocolVersion
from paho.mqtt.exception import MalformedPacket
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from wire import paho_decode
from wire.paho_decode import decode_publish

pytestmark = pytest.mark.unit

V5 = MQTTProtocolVersion.MQTTv5
paho_decode.install()
STOCK = paho_decode._stock
assert STOCK is not None


def _properties(rng: random.Random) -> bytes:
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    if rng.random() < 0.6:  # one or more: 1-byte and multi-byte variable integers
        properties.SubscriptionIdentifier = rng.sample([1, 127, 128, 16_384, 268_435_455], 2)
    if rng.random() < 0.3:
        properties.UserProperty = [("kind", "activations"), ("seq", str(rng.randrange(99)))]
    if rng.random() < 0.3:
        properties.MessageExpiryInterval = rng.randrange(1, 2**32)
    if rng.random() < 0.3:
        properties.CorrelationData = rng.randbytes(rng.randrange(0, 40))
    if rng.random() < 0.2:
        properties.ResponseTopic = "edgesplit/v1/reply"
    if rng.random() < 0.2:  # a byte, a two-byte integer, a string
        properties.PayloadFormatIndicator = rng.randrange(2)
    if rng.random() < 0.2:
        properties.TopicAlias = rng.randrange(1, 65_536)
    if rng.random() < 0.2:
        properties.ContentType = "application/x-edgesplit"
    return bytes(properties.pack())  # type: ignore[no-untyped-call]


def _packet_of(rng: random.Random, qos: int) -> bytearray:
    topic = rng.choice([b"", b"t", b"edgesplit/v1/run/stream/gpu-0", "\u00e9t\u00e9".encode()])
    mid = struct.pack("!H", rng.randrange(1, 65_536)) if qos else b""
    payload = rng.randbytes(rng.choice([0, 1, 300, 70_000]))
    return bytearray(struct.pack("!H", len(topic)) + topic + mid + _properties(rng) + payload)


def _outcome(decoder: Any, header: int, packet: bytes | bytearray) -> tuple[Any, ...]:
    try:
        out = decoder(header, packet, V5)
    except Exception as error:
        return ("error", type(error).__name__)
    return (
        out.dup,
        out.qos,
        out.retain,
        out.topic,
        out.mid,
        str(out.properties),
        out.payload,
        type(out.topic),
        type(out.payload),
    )


def test_well_formed_packets_decode_as_paho_decodes_them() -> None:
    rng = random.Random(7)
    for _ in range(400):
        qos = rng.randrange(3)
        header = 0x30 | qos << 1 | rng.randrange(2) | rng.randrange(2) << 3
        packet = _packet_of(rng, qos)
        source = bytes(packet) if rng.random() < 0.5 else packet  # paho hands a bytearray
        assert decode_publish(header, source, V5) is not None
        assert _outcome(decode_publish, header, source) == _outcome(STOCK, header, source)


def test_broken_packets_go_to_paho_or_decode_the_same() -> None:
    rng, fast = random.Random(11), 0
    for _ in range(3000):
        qos = rng.randrange(3)
        header = 0x30 | qos << 1
        packet = _packet_of(rng, qos)[: rng.randrange(0, 120)]
        for _ in range(rng.randrange(0, 3)):
            if packet:
                packet[rng.randrange(len(packet))] = rng.randrange(256)
        decoded = decode_publish(header, packet, V5)
        if decoded is not None:  # taken: then paho accepts it and gives the same
            fast += 1
            assert _outcome(decode_publish, header, packet) == _outcome(STOCK, header, packet)
    assert fast > 100  # the corpus does reach the fast path


@pytest.mark.parametrize(
    "packet",
    [
        b"\x00",  # shorter than a topic length
        b"\x00\x05ab",  # topic longer than the packet
        b"\x00\x01t\x80\x00",  # properties' length in two bytes where one would do
        b"\x00\x01t\x80\x80\x80\x80\x01",  # a fifth length byte
        b"\x00\x01t\x05\x0b\x01",  # properties longer than the packet
        b"\x00\x01t\x02\x63\x00",  # an unknown property (99)
    ],
)
def test_what_it_does_not_handle_is_left_to_paho(packet: bytes) -> None:
    assert decode_publish(0x30, packet, V5) is None


def test_mqtt_v3_is_left_to_paho() -> None:
    assert decode_publish(0x30, b"\x00\x01tpayload", MQTTProtocolVersion.MQTTv311) is None


def test_the_payload_is_a_copy_of_its_own() -> None:
    packet = bytearray(b"\x00\x01t\x00payload")
    decoded = decode_publish(0x30, packet, V5)
    assert decoded is not None
    packet[-1:] = b"!"
    assert decoded.payload == b"payload"


def test_only_a_fast_client_s_packet_takes_the_fast_path(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def stock(header: int, packet: bytes | bytearray, protocol: MQTTProtocolVersion) -> Any:
        calls.append("stock")
        return STOCK(header, packet, protocol)

    monkeypatch.setattr(paho_decode, "_stock", stock)
    packet = b"\x00\x01t\x00payload"
    assert _packet.decode_publish(0x30, packet, V5).payload == b"payload"  # a stock client
    assert calls == ["stock"]
    paho_decode._local.fast = True  # what FastClient._handle_publish sets
    assert _packet.decode_publish(0x30, packet, V5).payload == b"payload"
    assert calls == ["stock"]  # decoded here, and the mark is spent:
    assert _packet.decode_publish(0x30, packet, V5).payload == b"payload"
    assert calls == ["stock", "stock"]
    paho_decode._local.fast = True  # a broken packet from a fast client: paho's error
    with pytest.raises(MalformedPacket):
        _packet.decode_publish(0x30, b"\x00", V5)
    assert calls == ["stock", "stock", "stock"]


def test_a_paho_whose_decoder_changed_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Another result type (a later paho): not wrapped, so its clients decode as stock."""
    assert paho_decode.install()  # the pinned paho: wrapped
    monkeypatch.setattr(paho_decode, "_stock", None)
    monkeypatch.setattr(_packet, "PublishPacket", collections.namedtuple("P", "topic payload"))
    wrapped = _packet.decode_publish
    assert not paho_decode.install()
    assert _packet.decode_publish is wrapped  # untouched
