"""A plan every edge refuses for what it is (its data, its memory) fails as a config error:
exit 2, which the systemd units do not restart into (they restarted every 5 s on exit 1).
An edge that did not answer is not that: it may answer later."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.errors import CoordinatorError, PlanRefused
from coordinator.planner import refused_error
from coordinator.service import Coordinator
from edgesplit.exits import EXIT_FAILURE, EXIT_USAGE, exit_for
from split_models.profiler import ModelProfile
from storage.base import RunStore
from tests.integration.test_coordinator_service import EDGES, config, start_fleet
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration


def test_a_plan_every_edge_refuses_for_its_data_fails_as_a_config_error(
    tmp_path: Path, store: RunStore, profile: ModelProfile, capsys: pytest.CaptureFixture[str]
) -> None:
    run = config(tmp_path, rounds=1, num_classes=5, eval_data=None)  # the digits go up to 9
    hub = InProcessHub()
    start_fleet(hub, tmp_path, {"pi-01": 1 << 30, "pi-02": 1 << 30}, {})
    coordinator = Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile)

    with pytest.raises(PlanRefused) as refused:
        coordinator.run()
    assert all(f"{edge}: " in str(refused.value) for edge in EDGES), refused.value
    assert exit_for("coordinator", refused.value) == EXIT_USAGE
    assert "too few edges accepted their blocks" in capsys.readouterr().err
    assert store.get_run("svc-1").status == "failed"


def test_a_plan_an_edge_did_not_answer_is_not_a_config_error() -> None:
    silent = {"pi-01": "did not answer the assignment within 60 s", "pi-02": "labels up to 9"}
    error = refused_error("too few edges accepted their blocks", silent)
    assert isinstance(error, CoordinatorError) and not isinstance(error, PlanRefused)
    assert exit_for("coordinator", error) == EXIT_FAILURE
    assert isinstance(refused_error("x", {"pi-02": "labels up to 9"}), PlanRefused)
