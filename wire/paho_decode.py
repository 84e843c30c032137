"""A PUBLISH decoder for edgesplit's paho clients that copies the payload once.

paho-mqtt decodes an incoming PUBLISH by slicing the rest of the packet at every field: the
topic length, the topic, the packet id, the properties' length, each property's identifier
and value. Each slice copies the payload, so a 64 KiB message with one subscription
identifier is copied seven times (29 us on the development machine), and an 832 KiB bundle
of 13 batches 718 us, more than the rest of its receipt. :func:`decode_publish` reads the
same fields in place and copies the payload once (the properties, a few bytes, are parsed by
paho's own :class:`~paho.mqtt.properties.Properties` from a slice of their own).

Only clients built by :func:`~wire.mqtt.paho_client` (:class:`FastClient`) use it: paho
calls a module function (``paho.mqtt._packet.decode_publish``), so that function is wrapped
once and takes the fast path only when a :class:`FastClient` is handling the packet on this
thread. Every other paho client in the process (a user's own, the raw baseline of
``benchmarks/transport.py``) decodes as stock paho does. Anything but a well-formed MQTT v5
PUBLISH goes to paho's decoder, so malformed packets fail exactly as they do in paho.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import paho.mqtt.client as mqtt
from paho.mqtt import _packet
from paho.mqtt.enums import MQTTErrorCode, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

__all__ = ["FastClient", "decode_publish", "install"]

Decoder = Callable[[int, "bytes | bytearray", MQTTProtocolVersion], _packet.PublishPacket]

_local = threading.local()
_lock = threading.Lock()
_stock: Decoder | None = None


def _varint(packet: bytes | bytearray, pos: int) -> tuple[int, int] | None:
    """A variable byte integer at ``pos``: (value, bytes used), or None when it is not a
    minimal one of at most four bytes inside the packet (paho's decoder then says why)."""
    value = 0
    for index in range(4):
        if pos + index >= len(packet):
            return None
        byte = packet[pos + index]
        value |= (byte & 0x7F) << (7 * index)
        if not byte & 0x80:
            if index and byte == 0:  # not the minimum number of bytes [MQTT-1.5.5-1]
                return None
            return value, index + 1
    return None


def decode_publish(
    header: int, packet: bytes | bytearray, protocol: MQTTProtocolVersion
) -> _packet.PublishPacket | None:
    """A well-formed MQTT v5 PUBLISH decoded as paho decodes it, with one copy of the
    payload; None for anything else (the caller falls back to paho)."""
    if protocol != MQTTProtocolVersion.MQTTv5 or len(packet) < 3:
        return None
    size = (packet[0] << 8) | packet[1]
    pos = 2 + size
    qos = (header & 0x06) >> 1
    mid = 0
    if qos:
        if pos + 2 > len(packet):
            return None
        mid = (packet[pos] << 8) | packet[pos + 1]
        pos += 2
    found = _varint(packet, pos)
    if found is None or pos + found[0] + found[1] > len(packet):
        return None
    end = pos + found[0] + found[1]
    properties = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
    try:
        properties.unpack(bytes(packet[pos:end]))  # type: ignore[no-untyped-call]
    except Exception:  # malformed: paho's decoder raises its own error for it
        return None
    with memoryview(packet) as view:
        return _packet.PublishPacket(
            dup=bool(header & 0x08),
            qos=qos,
            retain=bool(header & 0x01),
            topic=bytes(view[2 : 2 + size]),
            mid=mid,
            properties=properties,
            payload=bytes(view[end:]),
        )


def _dispatch(
    header: int, packet: bytes | bytearray, protocol: MQTTProtocolVersion
) -> _packet.PublishPacket:
    if _stock is None:  # only installed together
        raise RuntimeError("wire.paho_decode: paho's decoder is not wrapped")
    if _local.__dict__.pop("fast", False):
        decoded = decode_publish(header, packet, protocol)
        if decoded is not None:
            return decoded
    return _stock(header, packet, protocol)


_FIELDS = ("dup", "qos", "retain", "topic", "mid", "properties", "payload")


def install() -> bool:
    """Wrap paho's PUBLISH decoder once (idempotent; stock clients are not affected);
    whether it is wrapped. A paho whose private decoder is not the one this was written for
    (another name or result) is left alone: its clients then decode as stock paho does."""
    global _stock
    with _lock:
        if _stock is None:
            decoder = getattr(_packet, "decode_publish", None)
            result = getattr(_packet, "PublishPacket", None)
            if decoder is None or getattr(result, "_fields", None) != _FIELDS:
                return False
            _stock = decoder
            _packet.decode_publish = _dispatch
        return True


class FastClient(mqtt.Client):
    """A paho client whose incoming PUBLISH packets go through :func:`decode_publish`."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        install()
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def stop_reconnecting(self) -> None:
        """End the network loop at the next dropped link instead of reconnecting (paho sets
        the state it reconnects from after ``on_disconnect``, so a ``disconnect()`` there is
        undone)."""
        self._reconnect_on_failure = False

    def _handle_publish(self) -> MQTTErrorCode:
        _local.fast = True  # read (and cleared) by the decode this call makes first
        try:
            return super()._handle_publish()
        finally:
            _local.__dict__.pop("fast", None)
