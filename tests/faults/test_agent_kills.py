"""Agents SIGKILLed mid-round and restarted (issue 17): an edge, then the GPU server, in one
real deployment (every role its own ``edgesplit`` process, a private mosquitto, SQLite). The
run finishes, and no batch is trained twice into a committed round.

The tests share one deployment of three short rounds (its start, planning included, is most
of their time): the edge is killed in round 2, the GPU server in round 3; each test waits for
its own round, so either runs alone too."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.e2e.deployment import EDGES, Deployment
from tests.faults.conftest import Fleet
from tests.faults.watch import (
    ROUND_TIMEOUT,
    START_TIMEOUT,
    StreamWatch,
    read_log,
    status_of,
    trained_twice,
    wait_committed,
)

pytestmark = pytest.mark.e2e

PER_EDGE = 320  # 10 batches of 32 per edge and round: a round lasts a few seconds
OUTAGE = 2.0  # seconds the GPU server stays dead before it is started again


@pytest.fixture(scope="module")
def running(fleet: Fleet) -> Iterator[tuple[Deployment, StreamWatch]]:
    # the coordinator's default --max-attempts (3): waiting for the restarted GPU server costs
    # an attempt per deadline waited, not one per try (which failed such runs)
    deployment, watch = fleet(rounds=3, per_edge=PER_EDGE, deadline="30s")
    deployment.start_all()
    yield deployment, watch


def _no_batch_twice(deployment: Deployment, watch: StreamWatch) -> None:
    status = status_of(deployment)
    problems = trained_twice(status, PER_EDGE, watch, read_log(deployment.directory, "gpu-a"))
    assert problems == [], problems


def test_an_edge_killed_mid_round_and_restarted(
    running: tuple[Deployment, StreamWatch],
) -> None:
    deployment, watch = running
    watch.wait_batches("pi-03", 2, 2, START_TIMEOUT)  # its stream of round 2 is under way

    deployment.kill("pi-03")
    deployment.start_edge("pi-03")  # the device reboots: same name, new process
    status = wait_committed(deployment, 2)

    second = next(r for r in status["rounds"] if r["round"] == 2)
    failures = {d["device"]: d["failure"] for d in second["devices"] if d["failure"]}
    assert list(failures) == ["pi-03"], second
    # its new process came online within the will's grace: the round gave its task up then,
    # not at the deadline (the restart or the will, whichever the machine's speed shows first)
    assert "deadline" not in failures["pi-03"], failures
    assert sorted(d for d in second["participants"] if d != "pi-03") == ["pi-01", "pi-02"]
    _no_batch_twice(deployment, watch)


def test_the_gpu_server_killed_mid_round_and_restarted(
    running: tuple[Deployment, StreamWatch],
) -> None:
    deployment, watch = running
    watch.wait_batches("pi-01", 3, 2, START_TIMEOUT)  # round 3's streams are under way

    deployment.kill("gpu-a")
    time.sleep(OUTAGE)  # the server is away a while, not restarted at once
    deployment.start_gpu()
    coordinator = deployment.processes["coordinator"]

    assert coordinator.wait(ROUND_TIMEOUT * 2) == 0, deployment.log("coordinator")
    status = status_of(deployment)
    assert status["status"] == "finished"
    assert [r["state"] for r in status["rounds"]] == ["committed"] * 3
    third = status["rounds"][2]
    assert third["servers"] == ["gpu-a"] and set(third["participants"]) <= set(EDGES), third
    assert all(d["failure"] is None for d in third["devices"]), third
    tries = {attempt for (_, number, attempt) in watch.batches if number == 3}
    assert max(tries) > 1, f"round 3 was not tried again after the kill: tries {tries}"
    _no_batch_twice(deployment, watch)
