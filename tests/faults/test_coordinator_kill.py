"""The coordinator SIGKILLed while it waits for the devices, mid-round and right at a commit,
each time started again with the same command: the run finishes, each kill costs at most the
round it had open, the restarts do not profile the model again, and no checkpoint or ``.tmp``
file is left that the store does not refer to."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from storage import RoundRecord, StoreError, open_store
from tests.e2e.deployment import EDGES, Deployment
from tests.faults.restarts import RUN, Kill, kill_coordinator, orphans, restart, wait_for
from wire.broker import Broker

pytestmark = pytest.mark.e2e


def _state(rounds: list[RoundRecord], number: int) -> str | None:
    return next((r.state for r in rounds if r.number == number), None)


def _reopened(kill: Kill) -> Callable[[list[RoundRecord]], bool]:
    """Round ``kill.opened`` opened again after ``kill`` and has reached aggregation."""

    def condition(rounds: list[RoundRecord]) -> bool:
        again = [r for r in rounds if r.number == kill.opened and r.opened_at]
        return any(r.opened_at > kill.at and r.state != "open" for r in again)

    return condition


def test_coordinator_killed_three_times_finishes_with_nothing_lost_or_left(
    broker: Broker, tmp_path: Path
) -> None:
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    fleet = Deployment(broker.url, db, tmp_path, rounds=3, per_edge=160)  # short rounds
    kills: list[Kill] = []
    try:
        # 1. while it waits for the devices (none started yet)
        fleet.start_coordinator()
        wait_for(fleet, lambda _: _run_status(fleet) == "planning", 120, "the device wait")
        kills.append(kill_coordinator(fleet))
        fleet.start_gpu()
        for name in EDGES:
            fleet.start_edge(name)
        restart(fleet, kills[-1])
        # 2. in the middle of round 2
        wait_for(fleet, lambda r: _state(r, 2) == "open", 300, "round 2 to open")
        kills.append(kill_coordinator(fleet))
        restart(fleet, kills[-1])
        # 3. right at round 2's commit (aggregating, or just committed)
        wait_for(fleet, _reopened(kills[-1]), 300, "round 2 to aggregate")
        kills.append(kill_coordinator(fleet))
        restart(fleet, kills[-1])
        assert fleet.processes["coordinator"].wait(600) == 0, fleet.log("coordinator")
    finally:
        fleet.stop()

    with open_store(fleet.db, readonly=True) as store:
        run, found = store.get_run(RUN), store.list_rounds(RUN)
        resumed = [e.detail for e in store.events(RUN) if e.kind == "resumed"]
        taken = [e.detail for e in store.events(RUN) if e.kind == "lease-taken-over"]
        lease = store.lease(RUN)
    assert run.status == "finished" and [r.state for r in found] == ["committed"] * 3
    # each restart took the killed one's lease at once (its process gone), the last gave it back
    assert len(taken) == 3 and lease is None, (taken, lease)
    assert (kills[0].committed, kills[1].committed, kills[1].opened) == (0, 1, 2), kills
    assert kills[2].committed in (1, 2), kills
    for kill, detail in zip(kills, resumed, strict=True):  # no committed round trained again
        assert detail.startswith(f"after round {kill.committed} "), (kill, resumed)
        assert kill.reopened in (kill.committed + 1, None), kill  # at most the open one redone
    log = (tmp_path / "coordinator.log").read_text(errors="replace")  # every start's
    assert log.count("profiling cnn") == 1, "a restart profiled the model again"
    assert orphans(fleet) == []


def _run_status(fleet: Deployment) -> str | None:
    try:
        with open_store(fleet.db, readonly=True) as store:
            return store.get_run(RUN).status
    except StoreError:  # not created yet
        return None
