"""The rules that make a broker restart a non-event (issue 17), without a broker: a will
counts only after its grace (longer after the own reconnect, never while the own link is
down), a sender that said what it sent but whose batches stopped is missing them, a replaced
try's batches are refused, and a try cut short by the coordinator's own outage is redone
without counting as an attempt."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from coordinator.errors import CoordinatorError
from coordinator.outage import fail_repeat_losers, lost_senders, missing_batches
from coordinator.recorder import Outcome
from coordinator.runner import RoundRunner, RoundWork
from storage.records import DeviceResult
from wire import topics
from wire.agreement import RoundLedger
from wire.channel import Channel
from wire.codec import Envelope, encode
from wire.presence import WillGrace, incarnation_of, new_incarnation
from wire.stream import StreamServer
from wire.transport import InProcessHub

pytestmark = pytest.mark.unit

RUN, EDGE = "r1", "pi-01"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_will_counts_once_no_online_follows_within_the_grace() -> None:
    clock = _Clock()
    grace = WillGrace(grace=2.0, after_reconnect=15.0, clock=clock)
    grace.went_offline("pi-01")
    clock.now += 1.9
    assert grace.offline(["pi-01"]) == []
    clock.now += 0.2
    assert grace.offline(["pi-01", "pi-02"]) == ["pi-01"], "a killed device: after 2 s"
    grace.came_online("pi-01")
    assert grace.offline(["pi-01"]) == []


def test_a_will_followed_by_online_within_the_grace_never_counts() -> None:
    clock = _Clock()
    grace = WillGrace(grace=2.0, clock=clock)
    grace.went_offline("pi-01")  # a broker shutting down publishes it
    clock.now += 1.0
    grace.came_online("pi-01")  # the device reconnected
    clock.now += 60.0
    assert grace.offline(["pi-01"]) == []


def test_no_will_counts_while_the_own_link_is_down_nor_soon_after_it_is_back() -> None:
    clock = _Clock()
    grace = WillGrace(grace=2.0, after_reconnect=15.0, clock=clock)
    grace.went_offline("pi-01")
    clock.now += 10.0
    assert grace.offline(["pi-01"], link=(False, None)) == [], "link down: nothing is known"
    back = clock.now
    clock.now += 5.0  # a queued will arrives after the own reconnect, devices still coming
    assert grace.offline(["pi-01"], link=(True, back)) == []
    clock.now = back + 15.0
    assert grace.offline(["pi-01"], link=(True, back)) == ["pi-01"], "it stayed away"


def test_a_device_back_as_a_new_process_is_gone_for_work_begun_before_it() -> None:
    clock = _Clock()
    grace = WillGrace(grace=2.0, clock=clock)
    first, second = new_incarnation(), new_incarnation()
    grace.came_online("pi-01", first)
    begun = clock.now  # a GPU server starts waiting on pi-01's stream
    clock.now += 1.0
    grace.went_offline("pi-01")  # killed
    clock.now += 0.5
    grace.came_online("pi-01", second)  # restarted within the grace
    assert grace.offline(["pi-01"], since=begun) == ["pi-01"], "its round died with it"
    assert grace.offline(["pi-01"]) == [], "online for what follows"
    assert grace.offline(["pi-01"], since=clock.now + 0.1) == []
    grace.came_online("pi-01", second)  # a reconnection of the same process: no restart
    later = clock.now + 1.0
    clock.now += 5.0
    assert grace.offline(["pi-01"], since=later) == []


def test_an_incarnation_is_sixteen_hex_digits_or_none() -> None:
    assert len(new_incarnation()) == 16 and new_incarnation() != new_incarnation()
    assert incarnation_of(b"online 7 0123456789abcdef") == "0123456789abcdef"
    for payload in (
        b"online 7",
        b"offline",
        b"online 7 0123",
        b"online 7 " + b"f" * 5000,
        b"online 7 0123456789ABCDEF",
        b"online 7 0123456789abcdef extra",
    ):
        assert incarnation_of(payload) == "", payload


def test_a_ledger_says_which_senders_are_short_of_what_they_declared() -> None:
    ledger = RoundLedger(1, ["pi-01", "pi-02", "pi-03"], "gpu-a")
    ledger.declare("pi-01", 3)
    ledger.declare("pi-02", 1)
    for sender in ("pi-01", "pi-01", "pi-02"):
        ledger.handled(sender)
    ledger.settle()
    assert ledger.short() == {"pi-01": 1}, "pi-02 finished, pi-03 said nothing yet"


def _until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _batch(seq: int, attempt: int, index: int) -> bytes:
    meta = {"epoch": "e1", "cut": 1, "attempt": attempt, "batch": index}
    x = np.ones((2, 4), np.float32)
    return encode(Envelope("activations", RUN, EDGE, seq, 1, meta, {"x": x}))


def test_a_server_names_a_sender_missing_batches_and_refuses_a_replaced_try() -> None:
    hub = InProcessHub()
    handled: list[Envelope] = []
    server = StreamServer(Channel(hub.connect("gpu"), "gpu-a"), RUN, "seg-0", handled.append)
    server.begin_round(1, [EDGE], attempt=2)
    raw = hub.connect("raw")
    topic = topics.activations(RUN, "seg-0", EDGE)
    raw.publish(topic, _batch(0, 1, 0))  # try 1's batch, delivered late: refused
    raw.publish(topic, _batch(1, 2, 0))
    raw.publish(topic, _batch(2, 2, 2))  # batch 1 of try 2 was lost on the way
    done = Channel(hub.connect("done"), EDGE)
    done.send(
        topics.done(RUN, EDGE), "round_control", RUN, round=1, meta={"batches": 3, "attempt": 2}
    )

    assert _until(lambda: len(handled) == 2)
    assert server.stats.rejected["stale_attempt"] == 1
    assert not server.wait_round(30.0, quiet=0.3), "missing a batch: not finished"
    assert server.missing(0.3) == {EDGE: 1} and server.finished == set()


@pytest.fixture(autouse=True)
def _identity() -> None:
    """Flower messages need the process's task identity (the grid sets it in a coordinator)."""
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1


def _reply(missing: str) -> Message:
    content = RecordDict({"report": ConfigRecord({"missing": missing, "late": ""})})
    return Message(content, dst_node_id=0, message_type="train")  # a server's reply's content


def test_a_try_with_missing_batches_does_not_commit() -> None:
    replies = {"gpu-a": _reply(EDGE), "gpu-b": _reply("")}
    assert (
        missing_batches(["gpu-a", "gpu-b"], replies) == f"gpu-a: batches of {EDGE} lost on the way"
    )
    assert missing_batches(["gpu-b"], replies) is None


class _Link:
    link_epoch, connected = 0, True


class _Grid:
    """A grid whose broker link drops during every try's collect."""

    def __init__(self) -> None:
        self.transport = _Link()

    def push_messages(self, messages: Any) -> list[str]:
        self.transport.link_epoch += 1  # the broker went away while the try ran
        return [f"m{i}" for i, _ in enumerate(messages)]

    def pull_messages(self, _ids: Any) -> list[Message]:
        return []

    def get_node_ids(self) -> list[int]:
        return [7]

    def abandon(self, _ids: Any) -> None:
        pass


class _Recorder:
    run_id = "run"

    def __init__(self) -> None:
        self.observer = self
        self.failures: list[int] = []
        self.events: list[str] = []

    def __getattr__(self, _name: str) -> Any:
        return lambda *_args, **_kwargs: None

    def failed(self, _number: int, attempt: int, _attempts: int, _why: str) -> None:
        self.failures.append(attempt)

    def event(self, _number: int, kind: str, _detail: str, _device: str | None = None) -> None:
        self.events.append(kind)


def test_tries_cut_short_by_a_broker_outage_are_redone_apart_from_the_attempts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    recorder, announced = _Recorder(), []
    runner = RoundRunner(
        _Grid(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        recorder,  # type: ignore[arg-type]
        seed=0,
        deadline=300.0,
        attempts=1,
        sleep=lambda _s: None,
        on_attempt=lambda _n, attempt: announced.append(attempt),
    )
    message = Message(RecordDict({"config": ConfigRecord()}), dst_node_id=7, message_type="train")

    with (
        caplog.at_level(logging.INFO, logger="coordinator.runner"),
        pytest.raises(CoordinatorError, match="broker went away during 6 tries"),
    ):
        runner.run(1, lambda _n: RoundWork(["pi-01"], {"pi-01": message}))
    assert announced == [1, 2, 3, 4, 5, 6], "each redo is a new try the devices see"
    said = [r.getMessage() for r in caplog.records if r.name == "coordinator.runner"]
    assert said[:2] == [  # each try said (a retry was silent)
        "round 1: work sent to 1 device(s) (pi-01); deadline 300 s",
        "round 1 try 2: work sent to 1 device(s) (pi-01); deadline 300 s",
    ], said
    assert recorder.failures == [], "no outage counted against --max-attempts"
    assert recorder.events == ["broker-outage"] * 6


def test_a_sender_missing_batches_two_tries_running_fails_alone() -> None:
    replies = {"gpu-a": _reply(f"{EDGE},pi-02"), "gpu-b": _reply("pi-03")}
    assert lost_senders(["gpu-a", "gpu-b"], replies) == {EDGE, "pi-02", "pi-03"}
    assert lost_senders(["gpu-b"], {**replies, "gpu-b": _reply("")}) == set()

    def outcome() -> Outcome:
        devices = [EDGE, "pi-02", "pi-04", "gpu-a"]
        return Outcome([DeviceResult(d, examples=8) for d in devices], list(devices))

    first = outcome()
    assert not fail_repeat_losers(first, {EDGE}, set()), "first time: the round is redone"
    assert not fail_repeat_losers(first, {EDGE, "pi-02"}, {EDGE}), "pi-02 is new: redone"
    assert first.ok == [EDGE, "pi-02", "pi-04", "gpu-a"]

    again = outcome()
    assert fail_repeat_losers(again, {EDGE}, {EDGE, "pi-02"})
    assert again.ok == ["pi-02", "pi-04", "gpu-a"]
    failed = {r.device: r.failure for r in again.results if r.failure}
    assert list(failed) == [EDGE] and "two tries running" in str(failed[EDGE])
