"""A second coordinator started on a run another one drives (the same command run twice, a
restart before the first was stopped) is refused within seconds and leaves the first alone:
before run leases, both knocked each other off the broker (one MQTT client id) until both gave
up after six outages."""

from __future__ import annotations

import pytest

from storage import open_store
from tests.faults.conftest import Fleet
from tests.faults.restarts import RUN
from tests.faults.watch import status_of

pytestmark = pytest.mark.e2e


def test_a_second_coordinator_of_a_running_run_is_refused(fleet: Fleet) -> None:
    deployment, _ = fleet(rounds=2, per_edge=160)
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
