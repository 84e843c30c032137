"""A second coordinator started on a run another one drives (the same command run twice, a
restart before the first was stopped) is refused within seconds and leaves the first alone:
before run leases, both knocked each other off the broker (one MQTT client id) until both gave
up after six outages."""

from __future__ import annotations

import os
import signal
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import pytest
from sqlalchemy.engine import make_url

from storage import open_store
from tests.e2e.deployment import EDGES, Deployment
from tests.faults.conftest import Fleet
from tests.faults.restarts import RUN
from tests.faults.watch import status_of

pytestmark = pytest.mark.e2e


def test_a_second_coordinator_of_a_running_run_is_refused(fleet: Fleet) -> None:
    deployment, _ = fleet(rounds=2, per_edge=160)
    try:
        _second_refused(deployment)
    finally:
        deployment.stop()  # the next test starts devices of the same names


def _second_refused(deployment: Deployment) -> None:
    first = deployment.start_all()
    running = deployment.wait_until(lambda s: s["rounds"] != [], 300, "round 1")
    assert running["coordinator"]["pid"] == first.pid, running["coordinator"]

    second = deployment.start_coordinator("coordinator-2")
    assert second.wait(120) == 1, deployment.log("coordinator-2")
    refused = deployment.log("coordinator-2")
    assert "driven by another coordinator" in refused and f"pid {first.pid} " in refused

    assert first.wait(600) == 0, deployment.log("coordinator")
    # refused before it connected: the first was never knocked off the broker
    assert "MQTT connection lost" not in deployment.log("coordinator")
    status = status_of(deployment)
    assert status["status"] == "finished", status
    assert [r["state"] for r in status["rounds"]] == ["committed", "committed"], status
    with open_store(deployment.db, readonly=True) as store:
        kinds = [e.kind for e in store.events(RUN)]
        assert store.lease(RUN) is None  # given back at the end
    assert "broker-outage" not in kinds, kinds
    assert "lease-taken-over" not in kinds, kinds


@pytest.mark.parametrize("wake", ["SIGCONT", "SIGTERM"])
def test_a_frozen_coordinator_is_taken_over_and_wakes_up_without_a_trace(
    fleet: Fleet, wake: str
) -> None:
    # SIGSTOP for longer than its lease: a successor takes the run over. Woken (SIGCONT: it
    # carries on where it stopped; SIGTERM first: into its cancel path), the first must write
    # nothing and must not knock the successor (the same MQTT client id) off the broker
    deployment, _ = fleet(rounds=6, per_edge=160)
    try:
        _frozen_taken_over(deployment, wake == "SIGTERM")
    finally:
        deployment.stop()


def _frozen_taken_over(deployment: Deployment, terminate: bool) -> None:
    deployment.start_gpu()
    for name in EDGES:
        deployment.start_edge(name)
    first = deployment.start_coordinator("coordinator", *_SHORT_LEASE)
    deployment.wait_until(lambda s: s["rounds"] != [], 300, "round 1")
    _freeze_outside_a_write(first.pid, deployment.db)
    try:
        second = deployment.start_coordinator("coordinator-2", *_SHORT_LEASE)
        took = lambda s: (s["coordinator"] or {}).get("pid") == second.pid  # noqa: E731
        _wait(deployment, took, "the take-over")
        taken = status_of(deployment)["current_round"] or 0
        _wait(deployment, lambda s: (s["current_round"] or 0) > taken, "a successor's round")
        if terminate:
            first.send_signal(signal.SIGTERM)
    finally:
        os.kill(first.pid, signal.SIGCONT)

    assert first.wait(60) == 1, deployment.log("coordinator")
    assert "lease was taken over" in deployment.log("coordinator")
    assert second.wait(600) == 0, deployment.log("coordinator-2")
    status = status_of(deployment)
    assert status["status"] == "finished" and len(status["rounds"]) == 6, status
    with open_store(deployment.db, readonly=True) as store:
        kinds = [e.kind for e in store.events(RUN)]
    assert kinds.count("lease-taken-over") == 1 and "cancelled" not in kinds, kinds
    assert "MQTT connection lost" not in deployment.log("coordinator-2")


_SHORT_LEASE = ("--lease-seconds", "4")


def _freeze_outside_a_write(pid: int, db: str) -> None:
    """SIGSTOP ``pid`` at a moment it holds no write transaction on the SQLite file ``db``:
    frozen inside one it would block every writer, its successor too, which then stops naming
    the lock (SQLite's limit, not the lease's; `test_store_location` checks the message)."""
    path = make_url(db).database
    for _ in range(50):
        os.kill(pid, signal.SIGSTOP)
        while any(_state(pid, task) != "T" for task in os.listdir(f"/proc/{pid}/task")):
            time.sleep(0.01)  # every thread stopped: nothing begins a transaction now
        probe = sqlite3.connect(str(path), timeout=0.2, isolation_level=None)
        try:
            probe.execute("BEGIN IMMEDIATE")
            probe.execute("ROLLBACK")
            return
        except sqlite3.OperationalError:
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1)
        finally:
            probe.close()
    raise AssertionError(f"pid {pid} held the write lock at each of 50 tries to freeze it")


def _state(pid: int, task: str) -> str:
    try:
        with open(f"/proc/{pid}/task/{task}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except FileNotFoundError:  # a thread that ended meanwhile
        return "T"


def _wait(deployment: Deployment, condition: Callable[[dict[str, Any]], bool], what: str) -> None:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if condition(status_of(deployment)):
            return
        time.sleep(0.2)
    raise AssertionError(
        f"timed out waiting for {what}: {status_of(deployment)}\n"
        f"coordinator-2: {deployment.log('coordinator-2')[-3000:]}"
    )
