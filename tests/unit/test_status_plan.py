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
