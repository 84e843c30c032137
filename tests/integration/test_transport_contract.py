"""One contract for both transports: in-process and MQTT (a real mosquitto on loopback)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator

import numpy as np
import pytest

from wire import topics
from wire.broker import Broker
from wire.channel import Channel, Rejection
from wire.codec import Envelope, TensorSpec, encode
from wire.errors import TransportError
from wire.mqtt import MqttConfig, MqttTransport
from wire.transport import InProcessHub, InProcessTransport, Transport, Will

Factory = Callable[..., Transport]


class Inbox:
    """Collects deliveries and waits for them."""

    def __init__(self) -> None:
        self.items: list[object] = []
        self._condition = threading.Condition()

    def __call__(self, *item: object) -> None:
        with self._condition:
            self.items.append(item if len(item) > 1 else item[0])
            self._condition.notify_all()

    def wait(self, count: int, timeout: float = 10.0) -> list[object]:
        deadline = time.monotonic() + timeout
        with self._condition:
            while len(self.items) < count and time.monotonic() < deadline:
                self._condition.wait(0.05)
        return list(self.items)


def settle(seconds: float = 0.3) -> None:
    time.sleep(seconds)  # let subscriptions reach the broker before publishing


class TransportContract:
    @pytest.fixture
    def connect(self) -> Iterator[Factory]:
        raise NotImplementedError

    def test_publish_subscribe_with_wildcards(self, connect: Factory) -> None:
        publisher, subscriber = connect("pub"), connect("sub")
        exact, plus, hash_ = Inbox(), Inbox(), Inbox()
        subscriber.subscribe("edgesplit/v1/r/act/seg-a", exact)
        subscriber.subscribe("edgesplit/v1/r/act/+", plus)
        subscriber.subscribe("edgesplit/v1/#", hash_)
        settle()
        publisher.publish("edgesplit/v1/r/act/seg-a", b"one")
        publisher.publish("edgesplit/v1/r/act/seg-b", b"two")
        publisher.publish("edgesplit/v1/other", b"three")
        assert [p for _, p in hash_.wait(3)] == [b"one", b"two", b"three"]  # type: ignore[misc]
        assert [p for _, p in plus.wait(2)] == [b"one", b"two"]  # type: ignore[misc]
        assert exact.wait(1) == [("edgesplit/v1/r/act/seg-a", b"one")]

    def test_many_subscriptions_each_get_their_own(self, connect: Factory) -> None:
        """200 filters on one client (over MQTT, subscription identifiers above 127 take two
        bytes) and one wildcard over all of them: each message reaches its own filter's
        handler and the wildcard's, once, with its payload intact."""
        publisher, subscriber = connect("pub"), connect("sub")
        inboxes = [Inbox() for _ in range(200)]
        for index, inbox in enumerate(inboxes):
            subscriber.subscribe(f"edgesplit/v1/many/{index}", inbox)
        everything = Inbox()
        subscriber.subscribe("edgesplit/v1/many/+", everything)
        settle()
        picked = [0, 127, 128, 199]
        for index in picked:
            publisher.publish(f"edgesplit/v1/many/{index}", bytes([index % 256]) * 70_000)
        assert len(everything.wait(4)) == 4
        for index in picked:
            expected = [(f"edgesplit/v1/many/{index}", bytes([index % 256]) * 70_000)]
            assert inboxes[index].wait(1) == expected
        settle()  # nothing more comes, to these or to the others
        assert [len(inbox.items) for inbox in inboxes] == [int(i in picked) for i in range(200)]
        assert len(everything.items) == 4

    def test_a_burst_arrives_whole_and_in_order(self, connect: Factory) -> None:
        """Small messages faster than the broker acknowledges them (the MQTT transport then
        bundles them), a large one and a retained one in between: each arrives once, in the
        order sent, on its own topic; an empty one too."""
        publisher, subscriber = connect("pub"), connect("sub")
        inbox = Inbox()
        subscriber.subscribe("edgesplit/v1/burst/#", inbox)
        settle()
        sent = []
        for index in range(600):
            topic = f"edgesplit/v1/burst/{'a' if index % 50 < 40 else 'b'}"
            payload = index.to_bytes(4, "big") * {200: 0, 300: 100_000}.get(index, 2048)
            publisher.publish(topic, payload, retain=index == 450)
            sent.append((topic, payload))
        publisher.flush()
        assert inbox.wait(len(sent), timeout=30) == sent
        publisher.publish("edgesplit/v1/burst/a", b"", retain=True)  # clear the retained one

    def test_retained_presence_and_last_will(self, connect: Factory) -> None:
        device = f"pi-{uuid.uuid4().hex[:6]}"
        will = Will(topics.presence(device), b"offline")
        agent = connect(f"agent-{device}", will=will)
        agent.publish(topics.presence(device), b"online", retain=True)
        agent.flush()
        watcher = Inbox()
        observer = connect("observer")
        observer.subscribe(topics.presence(device), watcher)
        assert watcher.wait(1) == [(topics.presence(device), b"online")]  # retained
        agent.kill()
        assert watcher.wait(2, timeout=60)[-1] == (topics.presence(device), b"offline")
        late = Inbox()
        connect("late").subscribe(topics.presence(device), late)
        assert late.wait(1) == [(topics.presence(device), b"offline")]

    def test_shared_subscription_splits_the_stream(self, connect: Factory) -> None:
        run = f"run-{uuid.uuid4().hex[:6]}"
        stream = topics.activations_filter(run, "seg-0")  # every edge's stream into seg-0
        first, second = Inbox(), Inbox()
        connect("gpu-a").subscribe(topics.shared("gpus", stream), first)
        connect("gpu-b").subscribe(topics.shared("gpus", stream), second)
        settle()
        edges = [connect(f"edge-{i}") for i in range(2)]
        for index in range(40):
            device = f"pi-0{index % 2}"
            edges[index % 2].publish(topics.activations(run, "seg-0", device), str(index).encode())
        deadline = time.monotonic() + 10
        while len(first.items) + len(second.items) < 40 and time.monotonic() < deadline:
            time.sleep(0.05)
        got = sorted(int(p) for _, p in [*first.items, *second.items])  # type: ignore[misc]
        assert got == list(range(40)), "each message reaches exactly one group member"
        assert first.items and second.items, "both consumers share the load"

    def test_channel_chunks_large_messages_and_drops_duplicates(self, connect: Factory) -> None:
        sender, receiver = Channel(connect("edge-c"), "pi-01", chunk_bytes=1 << 20), Inbox()
        listener = Channel(connect("gpu-c"), "gpu-a")
        topic = topics.activations("r", "seg-big", "pi-01")
        expect = {"x": TensorSpec("float32", (None, 1024)), "y": TensorSpec("int64", (None,))}
        listener.subscribe(topic, receiver, expect=expect)
        settle()
        x = np.random.default_rng(0).standard_normal((3000, 1024)).astype(np.float32)  # 12 MB
        sender.send(topic, "activations", "r", tensors={"x": x, "y": np.arange(3000)})
        (envelope,) = receiver.wait(1, timeout=30)
        assert isinstance(envelope, Envelope) and np.array_equal(envelope.tensors["x"], x)
        duplicate = encode(
            Envelope(
                "activations",
                "r",
                "pi-01",
                0,
                0,
                {"epoch": sender.epoch},
                {"x": x[:2], "y": np.arange(2)},
            )
        )
        sender.transport.publish(topic, duplicate)  # same (sender, epoch, kind, seq): redelivery
        sender.send(topic, "activations", "r", tensors={"x": x[:5], "y": np.arange(5)})
        received = receiver.wait(2, timeout=10)
        assert len(received) == 2 and listener.stats.duplicates == 1

    def test_malformed_messages_are_counted_and_dropped(self, connect: Factory) -> None:
        receiver, rejected = Inbox(), Inbox()
        listener = Channel(connect("gpu-m"), "gpu-a")
        topic = topics.activations("r", "seg-m", "pi-01")
        listener.listen(
            topic,
            lambda _topic, envelope: receiver(envelope),
            expect={"x": TensorSpec("float32", (None, 4))},
            on_reject=rejected,
        )
        settle()
        raw = connect("attacker")
        for payload in _malformed():
            raw.publish(topic, payload)
        raw.publish(topic, _batch(0, np.ones((2, 4), np.float32)))  # a good one still passes
        small = Channel(connect("gpu-small"), "gpu-b", max_message_bytes=4096)
        oversize = Inbox()
        small_topic = topics.activations("r", "seg-small", "pi-01")
        small.listen(small_topic, lambda _t, _e: None, on_reject=oversize)
        settle()
        raw.publish(small_topic, _batch(9, np.ones((512, 4), np.float32), epoch="b"))

        assert [r.reason for r in oversize.wait(1) if isinstance(r, Rejection)] == ["oversize"]
        (delivered,) = receiver.wait(1)
        assert isinstance(delivered, Envelope) and delivered.seq == 0
        rejections = [r for r in rejected.wait(5) if isinstance(r, Rejection)]
        assert sorted(r.reason for r in rejections) == sorted(
            ["framing", "shape", "non_finite", "framing", "kind"]
        )
        assert {r.topic for r in rejections} == {topic}
        # what a rejection can still tell: the header of a batch that failed on its tensors
        readable = {r.reason: r.header for r in rejections if r.reason in ("shape", "non_finite")}
        assert readable["shape"]["seq"] == 1 and readable["non_finite"]["seq"] == 2
        assert readable["non_finite"]["epoch"] == "a" and readable["non_finite"]["round"] == 0
        assert all(r.header == {} for r in rejections if r.reason == "framing")
        assert sum(listener.stats.rejected.values()) == 5
        assert small.stats.rejected["oversize"] == 1


def _batch(seq: int, x: np.ndarray, epoch: str = "a") -> bytes:
    return encode(Envelope("activations", "r", "pi", seq, 0, {"epoch": epoch}, {"x": x}))


def _malformed() -> list[bytes]:
    """Truncated header, wrong shape, NaN, garbage header, unknown kind (in that order)."""
    good = _batch(0, np.ones((2, 4), np.float32))
    nan = np.ones((2, 4), np.float32)
    nan[0, 0] = np.nan
    return [
        good[: len(good) // 2],
        _batch(1, np.ones((2, 5), np.float32)),
        _batch(2, nan),
        b"ESW1" + b"\xff" * 20,
        good.replace(b'"activations"', b'"exfiltrate!"'),
    ]


class TestInProcessTransport(TransportContract):
    pytestmark = pytest.mark.unit

    @pytest.fixture
    def connect(self) -> Iterator[Factory]:
        hub, made = InProcessHub(), []

        def factory(client_id: str, will: Will | None = None) -> InProcessTransport:
            made.append(hub.connect(client_id, will))
            return made[-1]

        yield factory
        for transport in made:
            transport.close()


class TestMqttTransport(TransportContract):
    pytestmark = pytest.mark.integration

    @pytest.fixture
    def connect(self, broker: Broker) -> Iterator[Factory]:
        made: list[MqttTransport] = []
        config = MqttConfig.from_url(broker.url, keepalive=2)

        def factory(client_id: str, will: Will | None = None) -> MqttTransport:
            made.append(MqttTransport(config, f"{client_id}-{uuid.uuid4().hex[:6]}", will))
            return made[-1]

        yield factory
        for transport in made:
            transport.close()


class TestSharedMqtt(TransportContract):
    """Logical clients sharing connections (``wire.shared``), two per connection here, so
    publisher and subscriber share one in some tests and not in others."""

    pytestmark = pytest.mark.integration

    @pytest.fixture
    def connect(self) -> Iterator[Factory]:
        from wire.shared import SharedMqtt

        # a broker of its own: retained messages other tests left on the shared one would
        # reach a view that joins a wildcard subscription (the connection mirrors them)
        with Broker() as own:
            pool = SharedMqtt(MqttConfig.from_url(own.url, keepalive=2), per_connection=2)
            yield pool.connect
            pool.close()


@pytest.mark.unit
def test_transport_refuses_payloads_above_its_limit() -> None:
    hub = InProcessHub()
    transport = hub.connect("edge")
    transport.max_payload = 4096
    with pytest.raises(TransportError, match="exceeds the transport's limit"):
        transport.publish("edgesplit/v1/x", b"x" * 8192)
    channel = Channel(transport, "pi-01", chunk_bytes=1024)  # a Channel chunks instead
    inbox = Inbox()
    Channel(hub.connect("gpu"), "gpu-a").subscribe("edgesplit/v1/x", inbox)
    channel.send("edgesplit/v1/x", "round_control", "r", tensors={"v": np.zeros(2000, np.float32)})
    (envelope,) = inbox.wait(1)
    assert isinstance(envelope, Envelope) and envelope.tensors["v"].shape == (2000,)
    transport.close()
