"""Every inbound decoder and handler, fed thousands of seeded hostile payloads: each returns a
valid value or raises the error type its module declares (``WireError`` from the codec, chunk
reassembly and the control records); a handler that drops bad input raises nothing at all. No
``IndexError``, ``KeyError``, ``struct.error``, ``RecursionError`` or a stray ``ValueError``
escapes."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from flwr.app import Context, Message
from flwr.clientapp import ClientApp

from coordinator.devices import DeviceRegistry
from tests.security.fuzz import FuzzGenerator
from wire import topics
from wire.channel import Channel
from wire.chunks import Reassembler
from wire.codec import Envelope, TensorSpec, decode, read_header
from wire.errors import WireError
from wire.flow import CreditGate
from wire.flower import FlowerNode, TransportGrid
from wire.roles import Announcement, Task, node_id_for
from wire.session import SessionWatch
from wire.stream import StreamServer
from wire.transport import Handler, Transport, matches, split_shared

pytestmark = pytest.mark.unit

CASES = 3000
RUN = "e2e-1"
NAMES = ("pi-01", "pi-02", "pi-03", "gpu-a")
EXPECT = {"x": TensorSpec("float32", (None, 4)), "y": TensorSpec("int64", (None,))}


@pytest.fixture(scope="module")
def payloads() -> list[bytes]:
    generator = FuzzGenerator(16, RUN, NAMES)
    return [generator.payload() for _ in range(CASES)]


@pytest.fixture(autouse=True)
def _quiet(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Thousands of rejections are logged as warnings; keep only errors."""
    caplog.set_level(logging.ERROR)
    yield


class _Capture(Transport):
    """Delivers synchronously in the caller's thread, so whatever a handler raises reaches
    the test instead of a mailbox thread's log."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}
        self.published: list[tuple[str, bytes]] = []

    def publish(self, topic: str, payload: bytes, retain: bool = False) -> None:
        self.published.append((topic, payload))

    def subscribe(self, topic_filter: str, handler: Handler) -> None:
        self.handlers[topic_filter] = handler

    def unsubscribe(self, topic_filter: str) -> None:
        self.handlers.pop(topic_filter, None)

    def close(self) -> None: ...

    def kill(self) -> None: ...

    def deliver(self, topic: str, payload: bytes) -> int:
        """Hand ``payload`` to every handler whose filter matches ``topic``; how many."""
        targets = [h for f, h in self.handlers.items() if matches(split_shared(f)[1], topic)]
        for handler in targets:
            handler(topic, payload)
        return len(targets)


def _fuzz(
    payloads: list[bytes], parse: Callable[[bytes], Any], allowed: tuple[type[Exception], ...]
) -> collections.Counter[str]:
    """Feed every payload to ``parse``: what came back ("ok") or which allowed error it
    raised, counted; any other exception fails the test naming the payload."""
    outcomes: collections.Counter[str] = collections.Counter()
    for index, payload in enumerate(payloads):
        try:
            parse(payload)
        except allowed as error:
            outcomes[type(error).__name__] += 1
            continue
        except Exception as error:
            raise AssertionError(
                f"case {index}: {type(error).__name__}: {error} on {payload[:120]!r} "
                f"({len(payload)} bytes)"
            ) from error
        outcomes["ok"] += 1
    return outcomes


def _delivered(transport: _Capture, topic_of: Callable[[int], str]) -> Callable[[bytes], Any]:
    """A parse function that delivers to ``transport`` on topics taken in turn."""
    counter = iter(range(1 << 30))

    def deliver(payload: bytes) -> None:
        if transport.deliver(topic_of(next(counter)), payload) == 0:
            raise AssertionError("no handler took the payload: the test is not wired")

    return deliver


def test_envelope_decode(payloads: list[bytes]) -> None:
    plain = _fuzz(payloads, decode, (WireError,))
    expecting = _fuzz(payloads, lambda payload: decode(payload, EXPECT), (WireError,))
    headers = _fuzz(payloads, read_header, ())  # a rejection's bookkeeping: never raises
    assert plain["ok"] > 0 and plain["WireError"] > CASES // 2, plain
    assert 0 < expecting["ok"] <= plain["ok"], expecting
    assert headers["ok"] == CASES


def test_chunk_reassembly(payloads: list[bytes]) -> None:
    reassembler = Reassembler(max_pending_bytes=1 << 20, timeout=1.0)

    def parse(payload: bytes) -> None:
        whole = reassembler.feed(payload)
        if whole is not None and not isinstance(whole, bytes):
            raise AssertionError(f"feed returned {whole!r}")

    outcomes = _fuzz(payloads, parse, (WireError,))
    assert outcomes["ok"] > 0 and outcomes["WireError"] > CASES // 2, outcomes
    assert reassembler.pending_bytes <= 1 << 20


@pytest.mark.parametrize("record", [Announcement, Task])
def test_control_records(payloads: list[bytes], record: type[Announcement | Task]) -> None:
    outcomes = _fuzz(payloads, record.parse, (WireError,))
    assert outcomes["WireError"] > CASES // 2, outcomes
    if record is Announcement:
        assert outcomes["ok"] > 0, outcomes  # the generator's valid announcements pass


def test_session_watch(payloads: list[bytes]) -> None:
    transport = _Capture()
    watch = SessionWatch(transport)
    watch.watch(RUN)
    outcomes = _fuzz(payloads, _delivered(transport, lambda _: topics.coordinator(RUN)), ())
    assert outcomes["ok"] == CASES


def test_grid_replies_and_presence(payloads: list[bytes]) -> None:
    transport = _Capture()
    grid = TransportGrid(transport)
    where = (
        topics.flower_out("mallory"),
        topics.flower_out("pi-01"),
        topics.presence("mallory"),
        topics.presence("pi-01"),
        f"{topics.PREFIX}/presence/12345",
    )
    outcomes = _fuzz(payloads, _delivered(transport, lambda i: where[i % len(where)]), ())
    assert outcomes["ok"] == CASES
    assert set(grid.get_node_ids()) <= {node_id_for("mallory"), node_id_for("pi-01"), 12345}


def test_flower_node(payloads: list[bytes]) -> None:
    transport = _Capture()
    app = ClientApp()
    answered: list[str] = []

    @app.query()
    def query(message: Message, _context: Context) -> Message:
        answered.append(message.metadata.message_id)
        return Message(message.content, reply_to=message)

    node = FlowerNode(transport, node_id_for("pi-01"), app, name="pi-01")
    outcomes = _fuzz(payloads, _delivered(transport, lambda _: topics.flower_in("pi-01")), ())
    assert outcomes["ok"] == CASES
    assert node.handled >= len(answered)


def test_device_registry(payloads: list[bytes]) -> None:
    transport = _Capture()
    registry = DeviceRegistry(transport, TransportGrid(transport))
    names = ("mallory", "pi-01")
    deliver = _delivered(transport, lambda i: topics.capabilities(names[i % 2]))
    outcomes = _fuzz(payloads, deliver, ())
    assert outcomes["ok"] == CASES
    assert registry.online() == {}  # no presence was delivered: nobody is online


def test_stream_server(payloads: list[bytes]) -> None:
    transport = _Capture()
    handled: list[Envelope] = []
    server = StreamServer(Channel(transport, "gpu-a"), RUN, "seg-0", handled.append)
    server.begin_round(1, ["pi-01"])
    where = (
        topics.activations(RUN, "seg-0", "mallory"),
        topics.activations(RUN, "seg-0", "pi-01"),
        topics.done(RUN, "mallory"),
        topics.done(RUN, "pi-01"),
        topics.processed(RUN, "mallory"),
    )
    outcomes = _fuzz(payloads, _delivered(transport, lambda i: where[i % len(where)]), ())
    assert outcomes["ok"] == CASES
    assert all(envelope.sender == "pi-01" for envelope in handled)
    assert sum(server.stats.rejected.values()) > 0


def test_credit_gate(payloads: list[bytes]) -> None:
    transport = _Capture()
    gate = CreditGate(Channel(transport, "pi-01"), RUN, "pi-01")
    deliver = _delivered(transport, lambda _: topics.credit(RUN, "pi-01"))
    outcomes = _fuzz(payloads, deliver, ())
    assert outcomes["ok"] == CASES
    assert gate.waited_seconds == 0.0
