"""``wire.shared``: many logical clients over a few connections to a real mosquitto."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tests.integration.test_transport_contract import Inbox, settle
from wire.broker import Broker
from wire.mqtt import MqttConfig
from wire.shared import SharedMqtt
from wire.transport import Will

pytestmark = pytest.mark.integration


@pytest.fixture
def shared(broker: Broker) -> Iterator[SharedMqtt]:
    pool = SharedMqtt(MqttConfig.from_url(broker.url, clean_start=True, session_expiry=0))
    yield pool
    pool.close()


def test_views_share_a_connection_and_get_only_their_messages(shared: SharedMqtt) -> None:
    exact, plus, other, publisher = (shared.connect(n) for n in ("exact", "plus", "other", "pub"))
    got_exact, got_plus, got_other = Inbox(), Inbox(), Inbox()
    exact.subscribe("t/route/a", got_exact)
    plus.subscribe("t/route/+", got_plus)
    other.subscribe("t/elsewhere", got_other)
    settle()
    publisher.publish("t/route/a", b"1")
    publisher.publish("t/route/b", b"2")
    assert got_plus.wait(2) == [("t/route/a", b"1"), ("t/route/b", b"2")]
    assert got_exact.wait(1) == [("t/route/a", b"1")]
    publisher.flush()
    settle()
    assert got_exact.items == [("t/route/a", b"1")] and got_other.items == []
    assert shared.connections == 1


def test_overlapping_filters_reach_each_of_a_views_handlers(shared: SharedMqtt) -> None:
    view, publisher = shared.connect("view"), shared.connect("pub")
    deep, shallow, exact = Inbox(), Inbox(), Inbox()
    view.subscribe("t/over/#", deep)
    view.subscribe("t/over/+", shallow)
    shared.connect("peer").subscribe("t/over/x", exact)  # the same topic, another view
    settle()
    publisher.publish("t/over/x", b"m")
    publisher.publish("t/over/x/y", b"n")
    assert deep.wait(2) == [("t/over/x", b"m"), ("t/over/x/y", b"n")]
    assert shallow.wait(1) == [("t/over/x", b"m")]
    assert exact.wait(1) == [("t/over/x", b"m")]


def test_a_shared_subscription_delivers_each_message_to_one_view(broker: Broker) -> None:
    config = MqttConfig.from_url(broker.url, clean_start=True, session_expiry=0)
    pool = SharedMqtt(config, per_connection=2)  # two members on one connection, one apart
    inboxes = [Inbox(), Inbox(), Inbox()]
    members = [pool.connect(f"gpu-{i}") for i in range(3)]
    for member, inbox in zip(members, inboxes, strict=True):
        member.subscribe("$share/gpus/t/act/+", inbox)
    publisher = pool.connect("edge")
    settle()
    for index in range(40):
        publisher.publish(f"t/act/e{index % 3}", str(index).encode())
    deadline = time.monotonic() + 10
    while sum(len(i.items) for i in inboxes) < 40 and time.monotonic() < deadline:
        time.sleep(0.05)
    settle()
    got = sorted(int(p) for inbox in inboxes for _, p in inbox.items)  # type: ignore[misc]
    assert got == list(range(40)), "each message reaches exactly one member"
    assert inboxes[0].items and inboxes[1].items, "members on one connection take turns"
    assert pool.connections == 2
    pool.close()


def test_kill_publishes_the_views_will_and_close_does_not(shared: SharedMqtt) -> None:
    watcher = Inbox()
    shared.connect("observer").subscribe("t/presence/+", watcher)
    killed = shared.connect("a", will=Will("t/presence/a", b"offline"))
    closed = shared.connect("b", will=Will("t/presence/b", b"offline"))
    after_kill = Inbox()
    killed.subscribe("t/presence/+", after_kill)
    killed.publish("t/presence/a", b"online", retain=True)
    closed.publish("t/presence/b", b"online", retain=True)
    assert len(watcher.wait(2)) == 2 and len(after_kill.wait(2)) == 2
    closed.close()
    killed.kill()
    assert watcher.wait(3)[-1] == ("t/presence/a", b"offline")
    settle()
    assert [p for t, p in watcher.items if t == "t/presence/b"] == [b"online"]  # type: ignore[misc]
    assert len(after_kill.items) == 2, "a killed view hears nothing more"
    late = Inbox()  # the will is retained, like the broker's
    shared.connect("late").subscribe("t/presence/a", late)
    assert late.wait(1) == [("t/presence/a", b"offline")]


def test_a_view_joining_a_subscription_gets_its_retained_messages(shared: SharedMqtt) -> None:
    first, second = Inbox(), Inbox()
    shared.connect("pub").publish("t/keep/x", b"kept", retain=True)
    shared.connect("first").subscribe("t/keep/+", first)
    assert first.wait(1) == [("t/keep/x", b"kept")]
    shared.connect("second").subscribe("t/keep/+", second)  # no new MQTT subscription
    assert second.wait(1) == [("t/keep/x", b"kept")]
    settle()
    assert len(first.items) == 1, "the first view does not get it again"


def test_a_blocked_handler_stalls_only_its_own_view(shared: SharedMqtt) -> None:
    release, entered, fast = threading.Event(), threading.Event(), Inbox()

    def blocking(_topic: str, _payload: bytes) -> None:
        entered.set()
        release.wait(30)

    slow_view, fast_view = shared.connect("slow"), shared.connect("fast")
    slow_view.subscribe("t/block/#", blocking)
    fast_view.subscribe("t/block/#", fast)
    settle()
    publisher = shared.connect("pub")
    publisher.publish("t/block/1", b"1")
    assert entered.wait(10)
    publisher.publish("t/block/2", b"2")
    assert [p for _, p in fast.wait(2)] == [b"1", b"2"]  # type: ignore[misc]
    release.set()


def test_an_idle_view_holds_no_thread(shared: SharedMqtt) -> None:
    view, inbox = shared.connect("idle"), Inbox()
    view.subscribe("t/idle", inbox)
    settle()
    shared.connect("pub").publish("t/idle", b"x")
    assert inbox.wait(1) == [("t/idle", b"x")]
    deadline = time.monotonic() + 10
    while view.mailbox.running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not view.mailbox.running
