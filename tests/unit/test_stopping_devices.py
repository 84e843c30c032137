"""A device stopped by its operator (SIGTERM, Ctrl-C) says so for the round it cuts short,
rather than blaming the coordinator for abandoning it."""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable

import pytest
from flwr.app import Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import SUPERLINK_NODE_ID
from flwr.supercore.task_identity import TaskIdentity

from gpu_server.agent import _abandoned
from wire.flower import node_will
from wire.roles import Announcement, go_online
from wire.transport import InProcessHub

pytestmark = pytest.mark.unit


def test_a_node_that_leaves_knows_it_is_leaving() -> None:
    hub = InProcessHub()
    announcement = Announcement("gpu-a", "gpu", 1 << 30, 1e10)
    node = go_online(announcement, hub.connect("gpu-a-control", node_will(1, "gpu-a")), ClientApp())
    assert not node.leaving
    node.leave()
    assert node.leaving


def test_a_round_cut_short_by_the_servers_own_stop_is_named_so(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # a message needs the run it belongs to (process-wide: set here, put back after)
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, SUPERLINK_NODE_ID, 1
    try:
        asked = Message(RecordDict(), dst_node_id=7, message_type="train")
        with caplog.at_level(logging.INFO, logger="gpu_server"):
            stopping = _abandoned(asked, 3, "gpu-a", leaving=True)
            replaced = _abandoned(asked, 3, "gpu-a", leaving=False)
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved

    assert stopping.error.reason == "round 3 left unfinished: GPU server gpu-a is stopping"
    assert "coordinator" not in stopping.error.reason
    assert "abandoned: the coordinator that asked for it stopped" in replaced.error.reason
    levels = {r.getMessage(): r.levelno for r in caplog.records}
    assert levels[stopping.error.reason] == logging.INFO  # not a warning: it was asked for
    assert levels[replaced.error.reason] == logging.WARNING


class _Connection:
    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_a_role_stopped_while_it_starts_closes_what_it_opened_and_exits_0(
    caplog: pytest.LogCaptureFixture,
) -> None:
    from edgesplit.exits import Signalled
    from split_models.runtime import serve

    opened = _Connection()

    def start(connections: list[_Connection]) -> Callable[[], None]:
        connections.append(opened)
        raise Signalled(signal.SIGTERM)  # as the command's handler raises it, mid-connect

    with caplog.at_level(logging.INFO, logger="edgesplit"):
        assert serve(start, "edge pi-01") == 0
    assert opened.closed
    assert "edge pi-01 stopped before it came online" in caplog.text


def _unhandled(signum: int, _frame: object) -> None:
    raise AssertionError(f"signal {signum} did not stop the role")


def test_a_role_serves_until_a_signal_then_runs_its_stop(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Its stop (seconds: the last messages acknowledged) was silent: it says so, and when
    it is done."""
    from split_models.runtime import serve

    stopped = []
    previous = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGHUP)).start()
    try:  # a hang-up the role does not take for a stop fails the test (not the whole run)
        signal.signal(signal.SIGHUP, _unhandled)
        with caplog.at_level(logging.INFO, logger="edgesplit"):
            assert serve(lambda _: lambda: stopped.append("left"), "gpu server g") == 0
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    assert stopped == ["left"]
    said = [r.getMessage() for r in caplog.records]
    assert said[0].startswith("gpu server g stopping: saying it is offline"), said
    assert said[1].startswith("gpu server g stopped ("), said
