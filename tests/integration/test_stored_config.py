"""The config a finished run left in its SQLite store parses back to the config it ran with,
and the readers of stored runs (status, export) take what they need from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import RunConfig
from coordinator.export import export_run
from simulation.config import parse_sim_config, run_config
from simulation.simulator import simulate
from split_models.config import TrainingConfig, stored_section
from storage import open_store
from storage.errors import NotFoundError
from storage.report import runs_overview

pytestmark = pytest.mark.integration


def _quick(method: str) -> dict[str, object]:
    return {"method": method, "clients": 2, "rounds": 1, "workers": 1, "measure_memory": False}


def test_a_simulated_runs_stored_config_parses_back(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    config = parse_sim_config(
        _quick("local-loss") | {"strategy": {"name": "fedprox", "proximal_mu": 0.1}}
    )
    summary = simulate(config, tmp_path, run_id="stored-1")
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        stored = store.get_run("stored-1").config
        (overview,) = runs_overview(store)
        exported = export_run(store, "stored-1", tmp_path / "onnx")
        with pytest.raises(NotFoundError, match=r"no round 9 .*; its committed rounds: 1$"):
            export_run(store, "stored-1", tmp_path / "onnx", round_number=9)
    parsed = RunConfig.parse(stored)
    assert parsed == run_config(config, "stored-1", f"npz:{tmp_path / 'test.npz'}")
    assert parsed.aggregation.options == {"proximal_mu": 0.1} and parsed.training.rounds == 1
    assert overview["rounds_planned"] == 1 and summary["rounds"]
    assert exported[0].ok and exported[0].blocks[0] == 0


def test_a_baseline_runs_stored_config_parses_as_the_simulation(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    config = parse_sim_config(_quick("centralized"))
    simulate(config, tmp_path, run_id="central-1")
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        stored = store.get_run("central-1").config
        (overview,) = runs_overview(store)
    assert parse_sim_config(stored) == config
    training = stored_section(TrainingConfig, stored)
    assert (training.rounds, training.optimizer) == (1, config.training.optimizer)
    assert overview["rounds_planned"] == 1


def test_fraction_train_samples_that_share_of_the_registered_clients_each_round(
    tmp_path: Path,
) -> None:
    pytest.importorskip("sklearn")
    config = parse_sim_config(
        _quick("local-loss")
        | {"clients": 40, "rounds": 2, "strategy": {"name": "fedavg", "fraction_train": 0.1}}
    )
    summary = simulate(config, tmp_path, run_id="sampled")
    assert [r["participants"] for r in summary["rounds"]] == [4, 4]
    trained = [c for c in summary["clients"] if c["examples"]]
    assert 4 <= len(trained) <= 8  # two rounds' samples (they may overlap), nobody else
    assert summary["final_accuracy"] is not None


def test_fraction_train_samples_at_least_min_train_nodes(tmp_path: Path) -> None:
    """A quarter of 4 clients with min_train_nodes 2 sampled one, and every try waited for a
    second that was online all along ('1 edge(s) online, 2 needed')."""
    pytest.importorskip("sklearn")
    strategy = {"name": "fedavg", "fraction_train": 0.25, "min_train_nodes": 2}
    config = parse_sim_config(_quick("local-loss") | {"clients": 4, "strategy": strategy})
    summary = simulate(config, tmp_path, run_id="least")
    assert [r["participants"] for r in summary["rounds"]] == [2]


def test_per_device_export_of_a_round_before_a_replan_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Only the latest plan is stored: round 1's device segments were cut as the re-plan
    after it said, without a word."""
    import logging

    from storage.records import Event

    pytest.importorskip("sklearn")
    simulate(parse_sim_config(_quick("local-loss") | {"rounds": 2}), tmp_path, run_id="moved")
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        store.add_event("moved", Event("replanned", "measured speeds: new cuts {}", None, 1))
        with caplog.at_level(logging.WARNING, logger="coordinator.export"):
            export_run(store, "moved", tmp_path / "late", round_number=2, per_device=True)
            assert "latest plan" not in caplog.text
            export_run(store, "moved", tmp_path / "early", round_number=1, per_device=True)
    assert "follow the run's latest plan, made after round 1; round 1 trained" in caplog.text
