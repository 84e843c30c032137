"""Grouped clients (``group_clients: true``, simulation.hosts): one agent per profile trains
its clients in turn and answers with their mean; for FedAvg the run trains as one with an
agent per client (simulations on the bundled digits, in-process)."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from simulation.config import parse_sim_config
from simulation.progress import RoundProgress
from simulation.simulator import _Fleet, simulate
from split_models.data import Dataset
from split_models.errors import ConfigError
from storage import DeviceResult, open_store
from storage.report import run_status
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration
pytest.importorskip("sklearn")


def _simulate(tmp_path: Path, tag: str, **fields: Any) -> tuple[dict[str, Any], Any, Any]:
    config = parse_sim_config(
        {"clients": 6, "rounds": 1, "measure_memory": False, "workers": 1, **fields}
    )
    summary = simulate(config, tmp_path / tag)
    with open_store(f"sqlite:///{tmp_path / tag / 'runs.db'}") as store:
        weights = store.resume(summary["run_id"]).weights["global"]  # type: ignore[union-attr]
        rounds = store.list_rounds(summary["run_id"])
    return summary, weights, rounds


def test_grouped_clients_train_the_front_blocks_as_an_agent_each_does(tmp_path: Path) -> None:
    _, apart, _ = _simulate(tmp_path, "apart")
    summary, grouped, rounds = _simulate(tmp_path, "grouped", group_clients=True)

    assert sorted(r.device for r in rounds[0].results) == ["gpu-sim", "host-0", "host-1"]
    assert {c["name"]: tuple(c["blocks"]) for c in summary["clients"]} == {
        "host-0": (0, 2),
        "host-1": (0, 5),
    }, "each profile's host takes the cut its clients took"
    # blocks 0 and 1 are trained by the edges alone: the mean of the hosts' means is the
    # mean over the clients (the back, trained on the hosts' streams, differs in batching)
    front = [k for k in apart if k.startswith(("block0.", "block1."))]
    assert front and all(np.allclose(apart[k], grouped[k], rtol=1e-4, atol=1e-6) for k in front)
    assert summary["final_accuracy"] > 0.5


def test_each_host_draws_fraction_train_of_its_clients_a_round(tmp_path: Path) -> None:
    # clients of unequal sizes: a draw of other clients trains another count of examples
    fields = {"group_clients": True, "rounds": 2, "clients": 8}
    fields["partition"] = {"kind": "dirichlet", "alpha": 0.5}
    strategy = {"name": "fedavg", "fraction_train": 0.5}
    _, _, rounds = _simulate(tmp_path, "half", strategy=strategy, **fields)
    _, _, whole = _simulate(tmp_path, "all", **fields)

    examples = [{r.device: r.examples for r in record.results} for record in rounds]
    everyone = {r.device: r.examples for r in whole[0].results}
    for host in ("host-0", "host-1"):
        drawn = [e[host] for e in examples]
        assert all(0 < n < everyone[host] for n in drawn), (drawn, everyone[host])
    assert examples[0] != examples[1], "another draw each round"


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"strategy": {"name": "krum"}}, "strategy 'krum', which judges each reply"),
        ({"method": "splitfed"}, "method 'splitfed'"),
        ({"batched": True}, "batched: true"),
        ({"federated_eval": 0.2}, "federated_eval"),
    ],
)
def test_settings_grouping_cannot_honour_are_refused_by_name(
    fields: dict[str, Any], named: str
) -> None:
    with pytest.raises(ConfigError, match=f"group_clients: true cannot be used with .*{named}"):
        parse_sim_config({"group_clients": True, **fields})


def test_a_host_whose_clients_are_all_offline_sits_the_round_out_by_name(tmp_path: Path) -> None:
    away = {"client-000": [2], "client-001": [2]}  # host-0's two clients, in round 2
    summary, _, rounds = _simulate(
        tmp_path, "away", group_clients=True, clients=4, rounds=2, availability={"offline": away}
    )

    results = {r.device: r for r in rounds[1].results}
    assert "none of host-0's clients is online" in (results["host-0"].failure or "")
    assert results["host-1"].failure is None and results["host-1"].examples > 0
    assert [r["participants"] for r in summary["rounds"]] == [2, 1]
    # the hosts' clients are counted too: in summary.json, in status, in the live table
    assert [r["clients"] for r in summary["rounds"]] == [4, 2]
    with open_store(f"sqlite:///{tmp_path / 'away' / 'runs.db'}") as store:
        status = run_status(store, summary["run_id"])
    assert [r["clients"] for r in status["rounds"]] == [4, 2]


def test_each_round_an_offline_client_misses_is_recorded(tmp_path: Path) -> None:
    # offline when the round began, it is sent nothing: each round still names it
    summary, _, _ = _simulate(
        tmp_path, "missed", clients=3, rounds=3, availability={"offline": {"client-001": [2, 3]}}
    )
    with open_store(f"sqlite:///{tmp_path / 'missed' / 'runs.db'}") as store:
        silent = [e for e in store.events(summary["run_id"]) if e.kind == "device-silent"]
    assert [(e.round, e.device) for e in silent] == [(2, "client-001"), (3, "client-001")]
    assert "offline when the round began" in silent[0].detail


def test_the_live_table_counts_the_hosts_clients() -> None:
    console = Console(file=io.StringIO(), width=100)
    progress = RoundProgress(1, "grouped", console=console, unit="hosts")
    results = [DeviceResult("host-0", examples=30), DeviceResult("host-1", failure="gone")]
    progress.round_committed(1, {"accuracy": 0.5, "loss": 1.0}, results, clients=3)
    progress.round_committed(2, {"accuracy": 0.5, "loss": 1.0}, results[:1], clients=1)

    printed = console.file.getvalue()  # type: ignore[attr-defined]
    assert "1/2 hosts trained (3 clients)" in printed
    assert "1/1 hosts trained (1 client)" in printed


def test_a_host_and_its_clients_hold_their_data_once() -> None:
    config = parse_sim_config({"clients": 4, "group_clients": True})
    rng = np.random.default_rng(0)
    data = {
        name: Dataset(rng.random((5, 1, 8, 8), dtype=np.float32), np.arange(5) % 10, 10)
        for name in config.fleet.client_profiles()
    }
    before = {name: d.x.copy() for name, d in data.items()}
    fleet = _Fleet(config, data, config.fleet.client_profiles(), InProcessHub().connect)
    try:
        for host, (_, clients) in config.fleet.hosts().items():
            agent = fleet._agents[host][0]
            for client in clients:  # views of the host's rows, the same values
                assert np.shares_memory(data[client].x, agent.data.x), (host, client)
                assert np.array_equal(data[client].x, before[client])
    finally:
        fleet.close()
