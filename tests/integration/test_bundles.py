"""Bundles over a real mosquitto: a sender ahead of its acknowledgements coalesces small
messages, a receiver splits them (the MQTT transport and shared connections alike), and a
broken bundle from a hostile client is dropped whole without stopping delivery."""

from __future__ import annotations

import struct
import uuid
from collections.abc import Iterator

import numpy as np
import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from tests.integration.test_transport_contract import Inbox, settle
from wire.broker import Broker
from wire.bundles import BUNDLE_MAGIC, bundle
from wire.channel import Channel
from wire.codec import Envelope, TensorSpec
from wire.mqtt import MqttConfig, MqttTransport
from wire.shared import SharedMqtt
from wire.transport import Transport

pytestmark = pytest.mark.integration

TOPIC = "edgesplit/v1/bundles/act"


@pytest.fixture
def transports(broker: Broker) -> Iterator[list[MqttTransport]]:
    made: list[MqttTransport] = []
    yield made
    for transport in made:
        transport.close()


def _connect(broker: Broker, made: list[MqttTransport], **overrides: int) -> MqttTransport:
    config = MqttConfig.from_url(broker.url, **overrides)
    made.append(MqttTransport(config, f"bundles-{uuid.uuid4().hex[:6]}"))
    return made[-1]


def _hostile(broker: Broker, payloads: list[bytes]) -> None:
    """A raw client publishing whatever it likes on the topic."""
    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    for payload in payloads:
        client.publish(TOPIC, payload, qos=1).wait_for_publish(10)
    client.disconnect()
    client.loop_stop()


def test_a_fast_sender_bundles_and_every_batch_arrives_validated(
    broker: Broker, transports: list[MqttTransport]
) -> None:
    sender = _connect(broker, transports)
    receiver = _connect(broker, transports)
    inbox = Inbox()
    spec = {"x": TensorSpec("float32", (None, 64))}
    Channel(receiver, "gpu-a").subscribe(TOPIC, inbox, expect=spec)
    settle()
    channel = Channel(sender, "pi-01")
    for index in range(400):
        channel.send(TOPIC, "activations", "r", tensors={"x": np.full((32, 64), index, "f4")})
        if index == 200:  # a bad topic fails the caller's publish, bundles or not
            with pytest.raises(ValueError):
                sender.publish("edgesplit/v1/+/act", b"x")
    sender.flush()
    got = inbox.wait(400, timeout=30)
    assert sender.bundles_sent > 0 and sender.bundled > sender.bundles_sent
    assert len(got) == 400
    assert all(isinstance(e, Envelope) for e in got)
    assert [int(e.tensors["x"][0, 0]) for e in got] == list(range(400))  # type: ignore[union-attr]


def test_bundle_bytes_zero_sends_each_message_alone(
    broker: Broker, transports: list[MqttTransport]
) -> None:
    sender = _connect(broker, transports, bundle_bytes=0)
    receiver = _connect(broker, transports)
    inbox = Inbox()
    receiver.subscribe(TOPIC, inbox)
    settle()
    for index in range(200):
        sender.publish(TOPIC, index.to_bytes(4, "big") * 1024)
    sender.flush()
    assert len(inbox.wait(200, timeout=30)) == 200
    assert sender.bundles_sent == 0


def _broken() -> list[bytes]:
    good = bundle([b"one", b"two"])
    return [
        BUNDLE_MAGIC + struct.pack("<II", 2, 3) + b"abc",  # lengths cut short
        BUNDLE_MAGIC + struct.pack("<III", 2, 3, 9) + b"abcdef",  # parts shorter than said
        good[:-1],  # truncated
        BUNDLE_MAGIC + struct.pack("<I", 0),  # no parts
        bundle([b"three"]),  # a sound one after them is still delivered
    ]


def test_a_broken_bundle_is_dropped_whole(broker: Broker, transports: list[MqttTransport]) -> None:
    receiver = _connect(broker, transports)
    inbox = Inbox()
    receiver.subscribe(TOPIC, inbox)
    settle()
    _hostile(broker, _broken())
    assert inbox.wait(1) == [(TOPIC, b"three")]
    assert receiver.malformed == 4


def test_shared_connections_split_bundles_too(broker: Broker) -> None:
    pool = SharedMqtt(MqttConfig.from_url(broker.url), per_connection=4)
    try:
        inbox = Inbox()
        view: Transport = pool.connect("gpu-a")
        view.subscribe(TOPIC, inbox)
        settle()
        _hostile(broker, [bundle([b"a", b"b"]), *_broken()])
        assert [p for _, p in inbox.wait(3)] == [b"a", b"b", b"three"]  # type: ignore[misc]
    finally:
        pool.close()
