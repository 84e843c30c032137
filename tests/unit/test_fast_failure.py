"""Fast failure detection, unit tier: a sender whose last will arrives leaves the round on the
stream server (its earlier batches trained, later ones refused), an edge whose GPU server goes
offline gives its round up naming it, and the coordinator's retries back off exponentially."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from coordinator.errors import CoordinatorError
from coordinator.runner import (
    RETRY_CAP_SECONDS,
    RoundRunner,
    RoundWork,
    retry_delay,
    wait_for_more,
)
from tests.unit.test_session import _trainer, _until
from wire import topics
from wire.channel import Channel
from wire.presence import PeerOffline, PresenceWatch
from wire.stream import StreamServer
from wire.transport import InProcessHub, Will

pytestmark = pytest.mark.unit


def _control(hub: InProcessHub, device: str) -> Any:
    """A device's control connection, whose last will says it went offline."""
    will = Will(topics.presence(device), b"offline", retain=True)
    control = hub.connect(f"{device}-control", will)
    control.publish(topics.presence(device), b"online 1", retain=True)
    return control


def _batch(channel: Channel, round_number: int = 1) -> None:
    x = np.zeros((2, 3), dtype=np.float32)
    channel.send(
        topics.activations("run", "seg-0", channel.sender),
        "activations",
        "run",
        round=round_number,
        tensors={"x": x, "y": np.zeros(2, dtype=np.int64)},
    )


def test_a_sender_gone_offline_leaves_the_round_with_its_batches_all_in() -> None:
    hub = InProcessHub()
    trained: list[str] = []
    server = StreamServer(
        Channel(hub.connect("gpu"), "gpu"), "run", "seg-0", lambda e: trained.append(e.sender)
    )
    presence = PresenceWatch(hub.connect("gpu-presence"))
    controls = {d: _control(hub, d) for d in ("pi-01", "pi-02")}
    edges = {d: Channel(hub.connect(d), d) for d in ("pi-01", "pi-02")}
    server.begin_round(1, ["pi-01", "pi-02"])
    for _ in range(2):
        _batch(edges["pi-02"])
    _batch(edges["pi-01"])
    edges["pi-01"].send(
        topics.done("run", "pi-01"), "round_control", "run", round=1, meta={"batches": 1}
    )
    _until(lambda: len(trained) == 3)
    ended = threading.Event()

    def wait() -> None:
        server.wait_round(3600.0, offline=lambda: presence.offline(["pi-01", "pi-02"]))
        ended.set()

    threading.Thread(target=wait, daemon=True).start()
    assert not ended.wait(0.3), "pi-02 is online and has not said what it sent"
    controls["pi-02"].kill()  # its last will: presence offline
    assert ended.wait(10.0), "the round did not end by the offline path"
    _batch(edges["pi-02"])  # arrives after the will
    _until(lambda: server.stats.rejected["gone"] == 1)
    assert server.stats.rejected["gone"] == 1, server.stats.rejected

    assert server.stats.left == {"pi-02": 1}
    assert server.gone == {"pi-02"} and server.finished == {"pi-01"}
    assert trained.count("pi-02") == 2, "what came before the will is in the back, nothing after"
    assert server.stats.handled["pi-02"] == 2


def test_an_edge_gives_up_a_round_whose_gpu_server_went_offline() -> None:
    hub = InProcessHub()
    gpu = _control(hub, "gpu-a")
    watch = PresenceWatch(hub.connect("pi-01-presence"))
    trainer = _trainer(hub, credit_timeout=3600.0)  # no credit ever comes
    threading.Timer(0.2, gpu.kill).start()
    with pytest.raises(PeerOffline, match="GPU server gpu-a went offline") as raised:
        trainer.train_round(3, offline=lambda: watch.offline(["gpu-a", "gpu-b"]))
    assert raised.value.devices == ["gpu-a"] and raised.value.round_number == 3


def test_presence_follows_the_latest_message() -> None:
    hub = InProcessHub()
    watch = PresenceWatch(hub.connect("watcher"))
    device = _control(hub, "pi-01")
    assert watch.offline(["pi-01", "never-seen"]) == []
    device.kill()
    _until(lambda: watch.offline(["pi-01"]) == ["pi-01"])
    _control(hub, "pi-01")  # back with a new connection
    _until(lambda: watch.offline(["pi-01"]) == [])
    assert watch.offline(["pi-01"]) == []


def test_retry_delays_double_up_to_the_cap() -> None:
    assert [retry_delay(a) for a in range(1, 7)] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert retry_delay(10_000) == RETRY_CAP_SECONDS
    with pytest.raises(ValueError, match="attempt"):
        retry_delay(0)


class _Recorder:
    run_id = "run"

    def __init__(self) -> None:
        self.observer = self
        self.failures: list[int] = []
        self.waits: list[int] = []

    def __getattr__(self, _name: str) -> Any:
        return lambda *_args, **_kwargs: None  # committed, baseline, open, round_starting

    def failed(self, _number: int, attempt: int, _attempts: int, _why: str) -> None:
        self.failures.append(attempt)

    def waiting(self, _number: int, attempt: int, _attempts: int, why: str) -> None:
        self.waits.append(attempt)
        self.last_failure = why


class _Grid:
    """The nodes online: ``comes`` joins after ``after`` looks."""

    def __init__(self, comes: int | None = None, after: int = 0) -> None:
        self.looks, self.comes, self.after = 0, comes, after

    def get_node_ids(self) -> list[int]:
        self.looks += 1
        return [self.comes] if self.comes is not None and self.looks > self.after else []


def test_tries_that_cannot_run_back_off_and_cost_an_attempt_per_deadline_waited() -> None:
    slept: list[float] = []
    recorder = _Recorder()
    runner = RoundRunner(
        _Grid(),  # type: ignore[arg-type]  # no try gets as far as sending
        None,  # type: ignore[arg-type]
        recorder,  # type: ignore[arg-type]
        seed=0,
        deadline=30.0,
        attempts=2,
        sleep=slept.append,
    )
    work = RoundWork([], problem="no GPU server holding blocks [1, 4) is online")
    with pytest.raises(CoordinatorError, match=r"failed 2 times \(last: no GPU server holding"):
        runner.run(2, lambda _number: work)
    # 1 + 2 + 4 + 8 + 10 + 10 = 35 s >= the 30 s deadline: one attempt, twice
    assert recorder.waits == [1, 2], "logged once per counted attempt, not per back-off"
    assert recorder.failures == [], "a wait for devices is no failed try"
    assert sum(slept) == pytest.approx(2 * 35.0)  # not deadline / 10 (3 s) each time
    assert max(slept) <= 0.2 + 1e-9  # in short naps, looking for a device coming back


def test_a_back_off_ends_when_a_device_comes_online() -> None:
    slept: list[float] = []
    grid = _Grid(comes=7, after=3)  # online at the third look after the first
    wait_for_more(grid.get_node_ids, 8.0, slept.append)
    assert sum(slept) == pytest.approx(0.6)  # three naps, not the 8 s back-off
    slept.clear()
    wait_for_more(_Grid().get_node_ids, 1.0, slept.append)
    assert sum(slept) == pytest.approx(1.0)


class _AnsweringGrid(_Grid):
    """Takes messages; node 2 answers at the third pull, node 1 never."""

    pulls = 0

    def push_messages(self, messages: Any) -> list[str]:
        return [f"id-{m.metadata.dst_node_id}" for m in messages]

    def pull_messages(self, ids: Any) -> list[Any]:
        self.pulls += 1
        if self.pulls == 3 and "id-2" in ids:
            return [SimpleNamespace(metadata=SimpleNamespace(reply_to_message_id="id-2"))]
        return []

    def abandon(self, _ids: Any) -> None:
        pass


def test_collecting_stops_for_a_device_that_went_offline_and_came_back() -> None:
    # a killed edge restarted at once is online again before the others finish, but its new
    # process knows nothing of the task: waiting for it would wait out the deadline
    slept: list[float] = []
    runner = RoundRunner(
        _AnsweringGrid(),  # type: ignore[arg-type]
        None,  # type: ignore[arg-type]
        _Recorder(),  # type: ignore[arg-type]
        seed=0,
        deadline=60.0,
        clock=lambda: sum(slept),
        sleep=slept.append,
    )
    looks = iter([{1, 2}, {2}, {1, 2}])  # pi-01 online, its will, back again
    runner._nodes = lambda: next(looks, {1, 2})  # type: ignore[method-assign]
    messages = {
        name: SimpleNamespace(metadata=SimpleNamespace(dst_node_id=node))
        for name, node in (("pi-01", 1), ("pi-02", 2))
    }
    replies = runner.collect(messages, deadline=60.0)  # type: ignore[arg-type]
    assert list(replies) == ["pi-02"]
    assert len(slept) == 2  # gave up once pi-02 answered, not at the deadline
