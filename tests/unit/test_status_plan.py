"""``edgesplit status --run``'s plan line, from whatever the store holds."""

from __future__ import annotations

import pytest

from coordinator.store_commands import _plan_line

pytestmark = pytest.mark.unit


def test_a_large_fleet_is_counted_per_cut_and_a_malformed_plan_shows_nothing() -> None:
    edges = [{"name": f"c-{i:03d}", "blocks": [0, 2 if i % 4 else 5]} for i in range(20)]
    plan = {"edges": edges, "servers": [{"name": "gpu-a", "blocks": [2, 6]}], "cuts": "uniform"}
    assert (
        _plan_line(plan) == "cuts {2: '15 edges', 5: '5 edges'} (uniform); GPU servers gpu-a [2, 6)"
    )
    for broken in (None, {}, {"edges": [{"name": "x"}], "servers": []}, {"edges": 3}):
        assert _plan_line(broken) is None


def test_a_rounds_failed_count_is_of_edges_as_its_participants_are() -> None:
    """A round read '4 participants, 3 failed' of four edges: the failed GPU servers were
    counted among the edges' failures."""
    from storage.records import DeviceResult, RoundRecord
    from storage.report import round_summary

    record = RoundRecord(
        "r",
        4,
        "committed",
        ("pi-01", "pi-02", "gpu-a"),
        (
            DeviceResult("pi-01", examples=32),
            DeviceResult("pi-02", examples=32),
            DeviceResult("pi-03", failure="offline"),
            DeviceResult("gpu-a", examples=64),
            DeviceResult("gpu-b", failure="offline"),
        ),
    )
    summary = round_summary(record, servers={"gpu-a", "gpu-b"})
    assert summary["participants"] == ["pi-01", "pi-02"] and summary["failed"] == ["pi-03"]
    assert summary["servers"] == ["gpu-a"] and summary["servers_failed"] == ["gpu-b"]
    assert summary["examples"] == 64 and summary["server_examples"] == 64
