"""The in-process hub routes through a tree of topic levels: it must deliver exactly what
checking every subscription with :func:`wire.transport.matches` would, in subscription order,
and hold no delivery thread for an idle client."""

from __future__ import annotations

import logging
import random
import threading
import time
from typing import Any

import numpy as np
import pytest

from wire.transport import Handler, InProcessHub, matches

_PARTS = ["a", "b", "c", "$sys"]


def _filter(rng: random.Random) -> str:
    parts = [rng.choice([*_PARTS, "+", "+"]) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.3:
        parts.append("#")
    return "/".join(parts)


def _topic(rng: random.Random) -> str:
    return "/".join(rng.choice(_PARTS) for _ in range(rng.randint(1, 4)))


def _recorder(into: list[Any], value: str | None = None) -> Handler:
    """A handler appending ``value`` (else the message's topic and payload) to ``into``."""

    def handler(topic: str, payload: bytes) -> None:
        into.append(value if value is not None else (topic, payload))

    return handler


def test_the_tree_delivers_what_matching_every_filter_would() -> None:
    rng = random.Random(7)
    hub = InProcessHub()
    got: list[tuple[int, str]] = []
    lock = threading.Lock()
    filters = [_filter(rng) for _ in range(60)] + ["#", "+/+", "a/#"]
    clients = []
    for index, topic_filter in enumerate(filters):
        client = hub.connect(f"c{index}")

        def record(topic: str, _payload: bytes, index: int = index) -> None:
            with lock:
                got.append((index, topic))

        client.subscribe(topic_filter, record)
        clients.append(client)
    clients[5].unsubscribe(filters[5])
    clients[6].close()
    topics = [_topic(rng) for _ in range(200)]
    for topic in topics:
        hub.publish(topic, b"x", retain=False)
    for client in clients:
        client.close()  # delivers what is queued
    live = [i for i in range(len(filters)) if i not in (5, 6)]
    expected = sorted((i, t) for t in topics for i in live if matches(filters[i], t))
    assert sorted(got) == expected
    assert any(t.startswith("$") for t in topics)  # the sample has '$' topics ...
    # ... which no filter starting with a wildcard hears
    assert not [t for i, t in got if t.startswith("$") and filters[i][:1] in ("+", "#")]


def test_one_client_hears_its_matching_subscriptions_in_the_order_it_made_them() -> None:
    hub = InProcessHub()
    client = hub.connect("one")
    heard: list[str] = []
    for name, topic_filter in (("hash", "a/#"), ("exact", "a/b"), ("plus", "+/b")):
        client.subscribe(topic_filter, _recorder(heard, name))
    hub.publish("a/b", b"", retain=False)
    client.close()
    assert heard == ["hash", "exact", "plus"]


def test_shared_groups_take_turns_and_retained_messages_reach_late_subscribers() -> None:
    hub = InProcessHub()
    heard: dict[str, list[Any]] = {"x": [], "y": []}
    members = [hub.connect(name) for name in heard]
    for member in members:
        member.subscribe("$share/g/jobs/+", _recorder(heard[member.client_id]))
    for index in range(4):
        hub.publish(f"jobs/{index}", b"", retain=False)
    hub.publish("state/a", b"on", retain=True)
    late = hub.connect("late")
    seen: list[bytes] = []
    late.subscribe("state/+", lambda _t, p: seen.append(p))
    for client in (*members, late):
        client.close()
    assert sorted(t for t, _ in heard["x"] + heard["y"]) == [f"jobs/{i}" for i in range(4)]
    assert len(heard["x"]) == len(heard["y"]) == 2
    assert seen == [b"on"]


def test_idle_clients_hold_no_delivery_thread() -> None:
    before = threading.active_count()
    hub = InProcessHub()
    clients = [hub.connect(f"idle-{i}") for i in range(200)]
    for client in clients:
        client.subscribe(f"to/{client.client_id}", lambda _t, _p: None)
    assert threading.active_count() - before < 5
    hub.publish("to/idle-3", b"", retain=False)
    assert clients[3].mailbox.running
    deadline = time.monotonic() + 5.0
    while clients[3].mailbox.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not clients[3].mailbox.running  # its thread ended after the idle spell
    for client in clients:
        client.close()


def test_a_new_subscription_gets_the_retained_messages_its_filter_matches() -> None:
    rng = random.Random(11)
    hub = InProcessHub()
    publisher = hub.connect("publisher")
    retained: dict[str, bytes] = {}
    for index in range(150):
        topic = _topic(rng)
        payload = b"" if rng.random() < 0.2 else str(index).encode()  # empty: cleared
        publisher.publish(topic, payload, retain=True)
        if payload:
            retained[topic] = payload
        else:
            retained.pop(topic, None)
    for index in range(40):
        topic_filter = _filter(rng) if index else "#"
        client = hub.connect(f"late-{index}")
        got: list[tuple[str, bytes]] = []
        client.subscribe(topic_filter, _recorder(got))
        client.close()
        expected = sorted((t, p) for t, p in retained.items() if matches(topic_filter, t))
        assert sorted(got) == expected, topic_filter


def test_flower_arrays_decode_as_flowers_own_parser_does() -> None:
    from flwr.app import Array

    from wire.flower import array_numpy

    samples: list[np.ndarray] = [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array(2.5, dtype=np.float64),
        np.ones((0, 5), dtype=np.int64),
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),  # another header: Flower's parser
        np.arange(4, dtype=">f4"),
        np.array([True, False]),
    ]
    for sample in samples:
        array = Array(sample)
        got, want = array_numpy(array), array.numpy()
        assert got.dtype == want.dtype and got.shape == want.shape
        assert np.array_equal(got, want) and got.flags.writeable
    lying = Array(dtype="float32", shape=(4, 3), stype="numpy.ndarray", data=Array(samples[0]).data)
    assert array_numpy(lying).shape == (3, 4)  # a header that disagrees: parsed, not trusted


def test_arrays_encode_byte_for_byte_as_flowers_own_encoder() -> None:
    from flwr.app import Array

    from wire.flower import array_numpy, numpy_array

    samples: list[np.ndarray] = [
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.array(2.5, dtype=np.float64),
        np.ones((0, 5), dtype=np.int64),
        np.arange(6, dtype=np.float16).reshape(2, 3),
        np.arange(4, dtype=">f4"),
        np.array([True, False]),
        np.arange(3, dtype=np.complex64),
        np.asfortranarray(np.arange(6.0).reshape(2, 3)),  # Flower's own path
        np.arange(12.0).reshape(3, 4)[:, ::2],  # strided: Flower's own path
    ]
    for sample in samples:
        got, want = numpy_array(sample), Array(sample)
        assert (got.dtype, got.shape, got.stype) == (want.dtype, want.shape, want.stype)
        assert got.data == want.data, sample
        assert np.array_equal(array_numpy(got), sample)


def test_a_handler_stopped_by_a_closed_transport_is_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A shutdown closes the transport a handler replies on: said at INFO; any other
    transport error stopping a handler stays a warning."""
    from wire.errors import TransportClosed, TransportError
    from wire.transport import _deliver

    def closed(_topic: str, _payload: bytes) -> None:
        raise TransportClosed("transport 'edge' is closed")

    def broken(_topic: str, _payload: bytes) -> None:
        raise TransportError("publish failed")

    with caplog.at_level(logging.INFO, logger="wire.transport"):
        _deliver(closed, "t/a", b"")
        _deliver(broken, "t/b", b"")
    levels = {r.getMessage().split(":")[0]: r.levelno for r in caplog.records}
    assert levels == {
        "handler for t/a stopped": logging.INFO,
        "handler for t/b stopped": logging.WARNING,
    }
