"""Bundles over a real mosquitto: a sender ahead of its acknowledgements coalesces small
messages, a receiver splits them (the MQTT transport and shared connections alike), and a
broken bundle from a hostile client is dropped whole without stopping delivery."""

from __future__ import annotations

import socket
import struct
import threading
import time
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


@pytest.mark.parametrize(
    "overrides",
    [
        {"bundle_bytes": 0},
        {"max_queued": 5},
        {"max_queued": 0},
        {"bundle_after": 63},
        {"bundle_after": 1},
    ],
)
def test_any_queue_setting_delivers_everything(
    broker: Broker, transports: list[MqttTransport], overrides: dict[str, int]
) -> None:
    """``bundle_bytes: 0`` sends no bundle. A bundle_after that paho's queue never leaves room
    for drained nothing from the network thread, which spun (the review's finding): bundles
    are off there instead."""
    sender = _connect(broker, transports, **overrides)
    receiver = _connect(broker, transports)
    inbox = Inbox()
    receiver.subscribe(TOPIC, inbox)
    settle()
    for index in range(300):
        sender.publish(TOPIC, index.to_bytes(4, "big") * 64)
    sender.flush(timeout=20)
    got = inbox.wait(300, timeout=20)
    assert [int.from_bytes(p[:4], "big") for _, p in got] == list(range(300))  # type: ignore[misc]
    if overrides.get("bundle_bytes") == 0:
        assert sender.bundles_sent == 0


def test_queue_settings_are_checked() -> None:
    with pytest.raises(ValueError, match="bundle_after"):
        MqttConfig(bundle_after=0)
    with pytest.raises(ValueError, match="max_queued"):
        MqttConfig(max_queued=-1)
    assert MqttConfig(max_payload=1024 * 1024).bundle_bytes == 512 * 1024  # capped


def test_reconnect_hooks_run_off_the_network_thread(
    broker: Broker, transports: list[MqttTransport]
) -> None:
    """A hook that blocks (one publishing into a full queue did) must not stop the network
    thread, which processes the acknowledgements the hook waits for."""
    config = MqttConfig.from_url(broker.url, reconnect_min=1, reconnect_max=1)
    sender = MqttTransport(config, f"bundles-{uuid.uuid4().hex[:6]}")
    transports.append(sender)
    receiver = _connect(broker, transports)
    inbox, release = Inbox(), threading.Event()
    receiver.subscribe(TOPIC, inbox)
    sender.on_reconnect(lambda: release.wait(30))
    settle()
    sock = sender._client.socket()
    assert sock is not None
    sock.shutdown(socket.SHUT_RDWR)  # paho reconnects; the hook then blocks
    deadline = time.monotonic() + 15
    while sender.last_reconnect is None and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        for index in range(50):
            sender.publish(TOPIC, index.to_bytes(4, "big"))
        sender.flush(timeout=10)  # acknowledged while the hook still waits
        assert len(inbox.wait(50, timeout=10)) == 50
    finally:
        release.set()


def test_unclaimed_messages_are_bounded_in_number_too(
    broker: Broker, transports: list[MqttTransport]
) -> None:
    """A bundle of 4,096 tiny parts is 4,096 kept messages: the bound counts entries as well
    as bytes."""
    receiver = _connect(broker, transports)
    for index in range(70_000):
        receiver._keep_unclaimed(TOPIC, index.to_bytes(4, "big"))
    assert len(receiver._unclaimed) == 65_536
    assert receiver._unclaimed[0][1] == (70_000 - 65_536).to_bytes(4, "big")  # oldest dropped


def test_a_retained_bundle_reaches_a_late_shared_view_split(broker: Broker) -> None:
    pool = SharedMqtt(MqttConfig.from_url(broker.url), per_connection=4)
    client = mqtt.Client(CallbackAPIVersion.VERSION2, protocol=mqtt.MQTTv5)
    client.connect("127.0.0.1", broker.port)
    client.loop_start()
    topic = f"{TOPIC}/retained-{uuid.uuid4().hex[:6]}"
    try:
        client.publish(topic, bundle([b"a", b"b"]), qos=1, retain=True).wait_for_publish(10)
        first, late = Inbox(), Inbox()
        pool.connect("gpu-a").subscribe(f"{TOPIC}/#", first)
        assert [p for _, p in first.wait(2)] == [b"a", b"b"]  # type: ignore[misc]
        pool.connect("gpu-b").subscribe(f"{TOPIC}/#", late)  # replayed by the connection
        assert [p for _, p in late.wait(2)] == [b"a", b"b"]  # type: ignore[misc]
    finally:
        client.publish(topic, b"", qos=1, retain=True).wait_for_publish(10)
        client.disconnect()
        client.loop_stop()
        pool.close()
