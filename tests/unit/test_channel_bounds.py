"""What a channel remembers of the streams it heard (to drop repeats) stays bounded whatever
a sender writes: epochs are short hex, and the least recently heard streams are forgotten."""

from __future__ import annotations

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
