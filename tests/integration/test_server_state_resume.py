"""A restarted coordinator goes on with the strategy's server-side optimizer state (FedAvgM's
momentum, FedOpt's moments) of its last committed round: 2 rounds, a restart, a third round
give the weights of 3 rounds in one go, bit for bit (simulations on the bundled digits,
in-process, one worker, SQLite file store)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.recorder import STRATEGY_SEGMENT
from simulation.config import parse_sim_config
from simulation.simulator import simulate
from storage import open_store
from storage.records import ResumeState

pytestmark = pytest.mark.integration
pytest.importorskip("sklearn")

RUN = "server-state"


def _simulate(out: Path, rounds: int, strategy: dict[str, Any]) -> ResumeState:
    config = parse_sim_config(
        {"rounds": rounds, "measure_memory": False, "workers": 1, "strategy": strategy}
    )
    simulate(config, out, run_id=RUN)
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        state = store.resume(RUN)
    assert state is not None and state.round.number == rounds
    return state


@pytest.mark.parametrize(
    "strategy",
    [
        {"name": "fedadam"},
        {"name": "fedavgm", "server_momentum": 0.9},
    ],
    ids=["fedadam", "fedavgm"],
)
def test_a_resumed_run_steps_on_with_the_server_state_of_its_last_round(
    tmp_path: Path, strategy: dict[str, Any]
) -> None:
    whole = _simulate(tmp_path / "whole", 3, strategy)

    _simulate(tmp_path / "split", 2, strategy)
    resumed = _simulate(tmp_path / "split", 3, strategy)  # a new coordinator: round 3

    a, b = whole.weights["global"], resumed.weights["global"]
    assert a.keys() == b.keys()
    differ = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not differ, f"resumed weights differ from uninterrupted ones in {differ[:5]}"
    saved = whole.optimizer_states[STRATEGY_SEGMENT]
    assert saved and all(np.isfinite(v).all() for v in saved.values())
    assert saved.keys() == resumed.optimizer_states[STRATEGY_SEGMENT].keys()
