"""A device that answers its train task with an error, on the coordinator service with real
agents on the in-process transport and a SQLite store."""

from __future__ import annotations

from pathlib import Path

import pytest
from flwr.app import Error, Message

from coordinator.service import Coordinator
from edge_client.agent import EdgeAgent
from split_models.profiler import ModelProfile
from storage.base import RunStore
from tests.integration.test_coordinator_service import EDGES, config, start_fleet
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration


def test_an_edge_that_answers_with_an_error_at_once_does_not_hold_the_round(
    tmp_path: Path, store: RunStore, profile: ModelProfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A device may answer its train task with an error and stream nothing, not even the
    count of nothing an honest edge sends: the GPU server waited for its stream until the
    round's deadline, every round. The coordinator tells the servers it is out."""
    honest = EdgeAgent._round

    def lying(agent: EdgeAgent, message: Message, job: object) -> Message:
        if agent.device == "pi-02":
            return Message(Error(code=1, reason="no thanks"), reply_to=message)
        return honest(agent, message, job)  # type: ignore[arg-type]

    monkeypatch.setattr(EdgeAgent, "_round", lying)
    run = config(tmp_path, rounds=2, round_deadline="300s")
    hub = InProcessHub()
    start_fleet(hub, tmp_path, dict.fromkeys(EDGES, 1 << 30), {})
    coordinator = Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile)
    assert coordinator.run() == 2

    for number in (1, 2):
        record = store.get_round("svc-1", number)
        failures = {r.device: r.failure for r in record.results if r.failure}
        assert "no thanks" in (failures.get("pi-02") or ""), failures
        # the server's wait ends on the coordinator's word, not at its deadline (270 s)
        took = record.committed_at - record.opened_at  # type: ignore[operator]
        assert took.total_seconds() < 60, took
    gpu = start_fleet.gpus[0]  # type: ignore[attr-defined]
    assert gpu._backs["svc-1"][1].stream.stats.left["pi-02"] == 2
