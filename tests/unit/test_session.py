"""Coordinator sessions: a device gives up a round that a replaced coordinator asked for."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from edge_client.trainer import EdgeTrainer, EdgeTrainerConfig
from split_models.data import Dataset
from split_models.segment import OptimizerConfig, Segment
from split_models.zoo import build_model
from wire import topics
from wire.channel import Channel
from wire.flow import CreditGate
from wire.session import RoundAbandoned, SessionGuard, SessionWatch, new_session
from wire.transport import InProcessHub, InProcessTransport

pytestmark = pytest.mark.unit


def _watch(hub: InProcessHub, run: str = "run") -> SessionWatch:
    watch = SessionWatch(InProcessTransport(hub, "device"))
    watch.watch(run)
    return watch


def _announce(hub: InProcessHub, session: str | bytes, run: str = "run") -> None:
    payload = session.encode() if isinstance(session, str) else session
    InProcessTransport(hub, "coordinator").publish(topics.coordinator(run), payload, retain=True)


def _until(condition: object, timeout: float = 5.0) -> None:
    """Wait until ``condition()`` holds; fail the test when it did not within ``timeout`` s
    (a wait that passed silently hid a batch that never came for 30 s)."""
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        if time.monotonic() >= deadline:
            raise AssertionError(f"not within {timeout:g} s: {condition}")
        time.sleep(0.01)


def test_session_ids_order_by_start_time() -> None:
    early, late = new_session(lambda: 1_000), new_session(lambda: 2_000)
    assert early < late
    assert new_session(lambda: 9) < new_session(lambda: 10)  # fixed width, not text order
    assert len({new_session(lambda: 5) for _ in range(20)}) > 1  # random tail


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_latest_announcement_is_the_session_even_with_a_lower_id() -> None:
    hub = InProcessHub()
    clock = _Clock()
    old, new = new_session(lambda: 100), new_session(lambda: 200)
    _announce(hub, old)
    watch = SessionWatch(InProcessTransport(hub, "device"), grace=3.0, clock=clock)
    watch.watch("run")  # the retained announcement arrives on subscribing
    _until(lambda: watch.replaced("run", new))
    assert not watch.replaced("run", old)
    assert not watch.replaced("run", None)  # work without a session is never abandoned
    assert not watch.replaced("other-run", new)
    # a task of `new` overtook its announcement: it waits for it, up to the grace
    clock.now += 1.0
    question = watch.follow("run", new)
    clock.now += 2.0
    assert not question()
    clock.now += 1.5
    assert question()  # `new` never announced itself: another process's work
    _announce(hub, new)
    _until(lambda: not watch.replaced("run", new))
    assert watch.replaced("run", old)
    # a restarted coordinator whose clock went back announces a lower id: it is followed
    clock.now += 1.0
    task_of_new = watch.follow("run", new)
    clock.now += 0.1
    lower = new_session(lambda: 50)
    _announce(hub, lower)
    _until(task_of_new)  # announced during the round: at once, no grace
    assert task_of_new() and not watch.replaced("run", lower)


def test_a_coordinator_announces_its_session_again_over_a_forgery() -> None:
    hub = InProcessHub()
    mine, guard = _guard(hub)
    watch = _watch(hub)
    _until(lambda: watch.replaced("run", "f" * 16 + "-00000000"))
    forged = "f" * 16 + "-deadbeef"  # the largest id there is: it used to hold devices for good
    _announce(hub, forged)
    _until(lambda: guard.foreign == [forged])
    assert guard.foreign == [forged]
    _until(lambda: not watch.replaced("run", mine))
    assert not watch.replaced("run", mine) and watch.replaced("run", forged)


@pytest.mark.parametrize("payload", [b"not-a-session", b"\xff" * 30, b"0" * 1000, b""])
def test_bad_announcements_are_dropped(payload: bytes, caplog: pytest.LogCaptureFixture) -> None:
    hub = InProcessHub()
    watch = _watch(hub)
    good = new_session(lambda: 300)
    _announce(hub, payload)
    _announce(hub, good)  # delivered in order, after the bad one
    _until(lambda: watch.replaced("run", new_session(lambda: 1)))
    assert watch.replaced("run", new_session(lambda: 1))
    assert not watch.replaced("run", good)
    if payload:
        assert "dropped a bad coordinator session" in caplog.text


def test_a_gate_stops_waiting_when_cancelled() -> None:
    gate = CreditGate(Channel(InProcessTransport(InProcessHub(), "e"), "e"), "run", "e")
    cancel = threading.Event()
    threading.Timer(0.2, cancel.set).start()
    started = time.monotonic()
    assert gate.acquire(60.0, cancel.is_set) is False
    assert time.monotonic() - started < 30.0  # long before the timeout


def _trainer(hub: InProcessHub, credit_timeout: float) -> EdgeTrainer:
    channel = Channel(InProcessTransport(hub, "pi-01"), "pi-01")
    gate = CreditGate(channel, "run", "pi-01")  # no GPU server: no credit ever comes
    rng = np.random.default_rng(0)
    data = Dataset(
        rng.normal(size=(16, 1, 8, 8)).astype(np.float32),
        rng.integers(0, 10, size=16).astype(np.int64),
        10,
    )
    segment = Segment.from_model(
        build_model("mlp", (1, 8, 8), 10, seed=0), 0, 1, "linear", OptimizerConfig("sgd")
    )
    config = EdgeTrainerConfig("run", "pi-01", "seg-0", batch_size=8, credit_timeout=credit_timeout)
    return EdgeTrainer(channel, gate, segment, data, config)


@pytest.mark.parametrize("replaced", [True, False])
def test_an_edge_gives_up_only_a_round_of_a_replaced_coordinator(replaced: bool) -> None:
    hub = InProcessHub()
    mine = new_session(lambda: 100)
    _announce(hub, mine)
    watch = _watch(hub)
    # waiting for a credit that never comes: abandoned when replaced, else the timeout
    trainer = _trainer(hub, credit_timeout=60.0 if replaced else 0.3)
    if replaced:
        threading.Timer(0.3, lambda: _announce(hub, new_session(lambda: 200))).start()
    expected = (RoundAbandoned, "round 3 abandoned") if replaced else (TimeoutError, "no credit")
    started = time.monotonic()
    with pytest.raises(expected[0], match=expected[1]):
        trainer.train_round(3, cancelled=lambda: watch.replaced("run", mine))
    assert time.monotonic() - started < 30.0  # long before the 60 s timeout


def _guard(hub: InProcessHub) -> tuple[str, SessionGuard]:
    """A coordinator's new session, announced on ``hub``."""
    mine = new_session()
    guard = SessionGuard(InProcessTransport(hub, "coordinator"), "run", mine)
    guard.start()
    return mine, guard


def test_a_later_attempt_or_round_cancels_the_earlier_one_on_a_device() -> None:
    hub = InProcessHub()
    mine, guard = _guard(hub)
    guard.attempt(3, 1)
    watch = _watch(hub)
    _until(lambda: watch.replaced("run", mine, work=(2, 1)))
    first_try = watch.follow("run", mine, (3, 1))
    assert not first_try() and watch.replaced("run", mine, work=(2, 5))
    guard.attempt(3, 2)  # the coordinator retries round 3
    _until(first_try)
    assert first_try()
    assert not watch.follow("run", mine, (3, 2))()
    guard.attempt(4, 1)
    _until(lambda: watch.replaced("run", mine, work=(3, 2)))
    assert watch.replaced("run", mine, work=(3, 2)) and not watch.replaced("run", mine, work=(4, 1))
    assert guard.foreign == []  # its own announcements are not taken for forgeries


def test_a_device_says_what_replaced_its_round() -> None:
    """After a link blip a retried round was told 'the coordinator that asked for it stopped
    or was replaced', which sent operators looking for a second coordinator."""
    hub = InProcessHub()
    mine, guard = _guard(hub)
    guard.attempt(3, 2)
    watch = _watch(hub)
    _until(lambda: watch.replaced("run", mine, work=(3, 1)))
    abandoned = watch.explained(RoundAbandoned(3), "run", mine, (3, 1))
    assert str(abandoned) == (
        "round 3 abandoned: the coordinator started try 2 of it (try 1 did not finish: its "
        "time ran out, or the broker went away; the coordinator's log says which)"
    )
    assert watch.why("run", mine, (3, 2)) is None  # the try under way
    guard.attempt(4, 1)
    _until(lambda: watch.replaced("run", mine, work=(3, 2)))
    assert watch.why("run", mine, (3, 2)) == "the coordinator went on to round 4"
    guard.end()
    _until(lambda: watch.replaced("run", mine, work=(4, 1)))
    assert watch.why("run", mine, (4, 1)) == "the run was stopped"
    restarted = InProcessHub()  # a coordinator restarted after a crash: a new session
    other_watch = _watch(restarted)
    _announce(restarted, new_session())
    _until(lambda: other_watch.replaced("run", mine, work=(4, 1)))
    assert "another coordinator process" in str(other_watch.why("run", mine, (4, 1)))
    other = ValueError("not a round abandoned")
    assert watch.explained(other, "run", mine, (4, 1)) is other


@pytest.mark.parametrize(
    "payload", [b"0123456789abcdef-01234567 3", b"0123456789abcdef-01234567 a b", b"x 1 2"]
)
def test_a_malformed_attempt_announcement_is_dropped(payload: bytes) -> None:
    from wire.session import parse_announcement

    assert parse_announcement(payload) is None
    assert parse_announcement(b"0123456789abcdef-01234567 3 2") == (
        "0123456789abcdef-01234567",
        (3, 2),
    )


def test_servers_hear_which_devices_are_out_of_a_try(caplog: pytest.LogCaptureFixture) -> None:
    """A device that answered its task with an error is out of that try: the try's retained
    announcement names it (a server watching late hears it too), for that session and try
    only; the guard takes its own word for no forgery."""
    hub = InProcessHub()
    mine, guard = _guard(hub)
    guard.attempt(3, 1)
    watch = _watch(hub)
    _until(lambda: watch.replaced("run", mine, work=(2, 1)))
    guard.out("pi-02", 3, 1)
    _until(lambda: watch.out("run", mine, (3, 1)))
    guard.out("pi-01", 3, 1)
    _until(lambda: len(watch.out("run", mine, (3, 1))) == 2)
    assert watch.out("run", mine, (3, 1)) == {"pi-01", "pi-02"}
    assert watch.out("run", mine, (3, 2)) == set() and watch.out("run", "other", (3, 1)) == set()
    late = _watch(hub, "run")  # retained: a server that starts watching now hears it
    _until(lambda: late.out("run", mine, (3, 1)))
    assert late.out("run", mine, (3, 1)) == {"pi-01", "pi-02"}
    guard.attempt(3, 2)  # the retry starts with nobody out
    guard.out("pi-09", 3, 1)  # late, of the try before: not named in the retry's
    guard.out("pi-03", 3, 2)
    _until(lambda: watch.out("run", mine, (3, 2)))
    assert watch.out("run", mine, (3, 2)) == {"pi-03"}
    assert not watch.replaced("run", mine, work=(3, 2)) and watch.replaced("run", mine, work=(3, 1))
    assert guard.foreign == [] and "dropped a bad" not in caplog.text


@pytest.mark.parametrize(
    "payload",
    [
        b"0123456789abcdef-01234567 3 1 out pi/01",  # not a name
        b"0123456789abcdef-01234567 3 1 in pi-01",
        b"0123456789abcdef-01234567 3 1 out pi-01,,pi-02",
        b"0123456789abcdef-01234567 3 x out pi-01",
        b"0123456789abcdef-01234567 3 1 out",
        b"0123456789abcdef-01234567 3 1 out " + b",".join(b"d%d" % i for i in range(4097)),
    ],
)
def test_an_announcement_with_a_malformed_out_list_is_dropped(payload: bytes) -> None:
    from wire.session import parse_announcement

    assert parse_announcement(payload) is None
    assert parse_announcement(b"0123456789abcdef-01234567 3 1 out pi-01,pi-02") == (
        "0123456789abcdef-01234567",
        (3, 1),
    )


class _Reconnecting(InProcessTransport):
    """An in-process client whose link can drop (its subscriptions stay with the broker's
    session, but messages published meanwhile never reach it) and come back."""

    def __init__(self, hub: InProcessHub, client_id: str) -> None:
        super().__init__(hub, client_id)
        self.hooks: list[object] = []
        self.down = False

    def on_reconnect(self, callback: object) -> None:  # type: ignore[override]
        self.hooks.append(callback)

    def subscribe(self, topic_filter: str, handler: object) -> None:  # type: ignore[override]
        super().subscribe(topic_filter, lambda t, p: None if self.down else handler(t, p))  # type: ignore[operator]

    def back(self) -> None:
        self.down = False
        for hook in self.hooks:
            hook()  # type: ignore[operator]


def test_an_announcement_missed_while_the_link_was_down_arrives_after_it_comes_back() -> None:
    """A second agent with the same id held the session while the run was stopped: the
    original sat inside the stopped round until its deadline (and then missed the next run's
    assignment). After a reconnection the watch subscribes again and the retained
    announcement comes anew."""
    hub = InProcessHub()
    mine, guard = _guard(hub)
    guard.attempt(4, 1)
    link = _Reconnecting(hub, "device")
    watch = SessionWatch(link)
    work = watch.follow("run", mine, (4, 1))
    _until(lambda: watch.replaced("run", mine, work=(3, 1)))
    link.down = True
    guard.end()  # the run stops while the device's link is down
    time.sleep(0.2)
    assert not work()
    link.back()
    _until(work)
    assert watch.why("run", mine, (4, 1)) == "the run was stopped"
