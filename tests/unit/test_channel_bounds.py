"""What a channel remembers of the streams it heard (to drop repeats) stays bounded whatever
a sender writes: epochs are short hex, and the least recently heard streams are forgotten."""

from __future__ import annotations

import collections
import threading
import time

import pytest

from wire import channel as channel_module
from wire import topics
from wire.channel import Channel
from wire.codec import Envelope, encode
from wire.transport import InProcessHub

pytestmark = pytest.mark.unit


def _wait(until: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not until() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.01)


def test_a_sender_minting_epochs_cannot_grow_what_a_receiver_remembers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(channel_module, "_STREAMS", 64)
    hub = InProcessHub()
    heard: list[Envelope] = []
    receiver = Channel(hub.connect("gpu"), "gpu-a")
    receiver.subscribe(topics.run_topic("r", "done") + "/+", heard.append)
    mallory = hub.connect("mallory")
    topic = topics.run_topic("r", "done") + "/mallory"

    def send(epoch: str, seq: int = 0) -> None:
        envelope = Envelope("round_control", "r", "mallory", seq, meta={"epoch": epoch})
        mallory.publish(topic, encode(envelope))

    for number in range(200):
        send(f"{number:x}")
    send("c7")  # heard lately: still remembered, dropped as a repeat
    send("a" * 30_000)  # each such epoch cost 30 KB of memory, for good
    _wait(lambda: receiver.stats.received + receiver.stats.duplicates == 201)
    _wait(lambda: sum(receiver.stats.rejected.values()) == 1)

    assert len(heard) == 200 and receiver.stats.duplicates == 1
    assert len(receiver._seen) == 64
    assert receiver.stats.rejected == {"header": 1}
    send("0")  # long forgotten: heard again (a repeat this old is the price of the bound)
    _wait(lambda: len(heard) == 201)
    assert len(heard) == 201


def test_a_flooded_mailbox_drops_the_flooding_topic_and_keeps_the_others() -> None:
    from wire.transport import Mailbox

    release, delivered = threading.Event(), collections.defaultdict(list)

    def handler(topic: str, payload: bytes) -> None:
        release.wait(10)
        delivered[topic].append(payload)

    mailbox = Mailbox("gpu-0", max_bytes=20_000)
    for seq in range(100):  # a device ignoring its credits, while the handler is busy
        mailbox.put(handler, "act/flood", seq.to_bytes(4, "big") * 250)
        if seq % 10 == 0:
            mailbox.put(handler, "act/honest", seq.to_bytes(4, "big") * 250)
    honest = 10 * (1000 + 128)  # under the bound: all of it waits
    assert mailbox.queued_bytes <= 20_000 + honest, "the flood stopped at the bound"
    release.set()
    _wait(lambda: mailbox.queued_bytes == 0)

    assert len(delivered["act/honest"]) == 10, "the other sender lost nothing"
    assert [p[:4] for p in delivered["act/honest"]] == [
        s.to_bytes(4, "big") for s in range(0, 100, 10)
    ]
    assert mailbox.dropped["act/flood"] == 100 - len(delivered["act/flood"]) > 70
    assert "act/honest" not in mailbox.dropped
    many = Mailbox("gpu-1", max_bytes=20_000)  # many honest senders: each under the bound
    release.clear()
    for sender in range(40):
        for _ in range(4):  # a window of 4 batches each: 180 KB wait in all
            many.put(handler, f"act/pi-{sender:02}", bytes(1000))
    assert many.queued_bytes > 20_000 * 4 and not many.dropped, "the bound is per topic"
    release.set()
    _wait(lambda: many.queued_bytes == 0)
    unbounded = Mailbox("sim")  # the in-process hub's clients: no bound
    assert not unbounded._over("act/flood", 10**12)


def test_the_inbound_bound_is_set_in_the_broker_url() -> None:
    from wire.mqtt_config import MqttConfig

    assert MqttConfig.from_url("mqtt://h:1883").inbound_bound == 512 * 1024**2  # the default
    assert MqttConfig.from_url("mqtt://h?inbound=4GiB").inbound_bound == 4 * 1024**3
    assert MqttConfig.from_url("mqtts://h?ca=c.crt&inbound=512M").inbound_bound == 512 * 1024**2
    assert MqttConfig.from_url("mqtt://h?inbound=0").inbound_bound is None  # unbounded
    with pytest.raises(ValueError, match="inbound='lots', expected bytes such as"):
        MqttConfig.from_url("mqtt://h?inbound=lots")
    with pytest.raises(ValueError, match="must hold one message"):
        MqttConfig.from_url("mqtt://h?inbound=512")  # 512 bytes, meant as MiB: all dropped


def test_a_lone_message_passes_the_bound_however_large() -> None:
    """A model-sized message (a retry for a busy GPU server) on a topic with nothing waiting
    is kept: the bound is for what piles up behind a slow handler."""
    from wire.transport import Mailbox

    busy, release, delivered = threading.Event(), threading.Event(), []

    def handler(_topic: str, payload: bytes) -> None:
        busy.set()
        release.wait(10)
        delivered.append(len(payload))

    mailbox = Mailbox("gpu-0", max_bytes=1000)
    mailbox.put(handler, "flower/in", bytes(1))  # the handler is busy with this one
    assert busy.wait(10)
    mailbox.put(handler, "flower/in", bytes(5000))
    mailbox.put(handler, "flower/in", bytes(10))  # behind a message past the bound: dropped
    release.set()
    _wait(lambda: mailbox.queued_bytes == 0 and len(delivered) == 2)
    assert delivered == [1, 5000] and mailbox.dropped["flower/in"] == 1
