"""Broker restarts are a non-event (issue 17): a real deployment (coordinator, GPU server,
three edges, each its own process) on a private mosquitto configured as the shipped one
(persistence on, its autosave interval), whose broker is stopped mid-round, SIGTERM in round 1
and SIGKILL in round 2, and started again 2 s later. The run finishes, and the logs say that
the committed tries lost no batch and trained none twice. (30 s outages and the costs:
``benchmarks/faults_broker.py``.)"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial
from pathlib import Path

import pytest

from storage import open_store
from tests.e2e.deployment import EDGES, Deployment, opened
from tests.faults.broker_run import PER_EDGE, Streaming, count_batches, shipped_autosave, shorten
from wire.broker import Broker

pytestmark = pytest.mark.e2e


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    with Broker(persistence=True, extra_config=shipped_autosave()) as instance:
        yield instance


def test_the_run_rides_through_a_terminated_and_a_killed_broker(
    broker: Broker, tmp_path: Path
) -> None:
    deployment = Deployment(broker.url, f"sqlite:///{tmp_path / 'runs.db'}", tmp_path, rounds=2)
    shorten(deployment, PER_EDGE)
    streaming = Streaming(broker)
    try:
        coordinator = deployment.start_all()
        for number, kill in ((1, False), (2, True)):
            deployment.wait_until(partial(opened, number=number), 300, f"round {number}")
            assert streaming.flowing(number).wait(120), f"no activations of round {number}"
            broker.restart(down=2.0, kill=kill)
        assert coordinator.wait(300) == 0, deployment.log("coordinator")
    finally:
        streaming.transport.close()
        deployment.stop()

    status = deployment.status()
    assert status["status"] == "finished"
    assert [(r["round"], r["state"]) for r in status["rounds"]] == [
        (1, "committed"),
        (2, "committed"),
    ]
    counted = count_batches(tmp_path, list(EDGES), ["gpu-a"])
    assert counted.sent > 0 and set(counted.tries) == {1, 2}
    assert (counted.lost, counted.twice) == (0, 0), counted
    with open_store(deployment.db) as store:
        kinds = [event.kind for event in store.events("e2e-1")]
    assert "broker-outage" in kinds, "the coordinator redid a try its link dropped in"
