"""A chain of GPU servers that loses a server: the back moves onto the servers left (real
agents on the in-process transport, a SQLite store)."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from coordinator.partitioner import PartitionConfig, Problem
from coordinator.recorder import RoundObserver
from coordinator.service import Coordinator
from gpu_server.agent import GpuAgent
from split_models.profiler import ModelProfile
from storage.base import RunStore
from storage.report import run_status
from tests.integration.test_coordinator_service import EDGES, config, start_fleet
from wire.flower import node_will
from wire.roles import Announcement, node_id_for
from wire.transport import InProcessHub, Transport

pytestmark = pytest.mark.integration


class _KillAfterRound(RoundObserver):
    """Kills the GPU server holding the chain's last piece once round ``after`` commits."""

    def __init__(self, store: RunStore, transports: dict[str, tuple[Transport, Transport]]):
        self.store, self.transports, self.killed = store, transports, ""

    def round_committed(self, number: int, *_args: object, **_kwargs: object) -> None:
        if number == 1:
            plan = self.store.get_run("svc-1").plan
            assert plan is not None
            self.killed = max(plan["servers"], key=lambda s: s["blocks"][0])["name"]
            control, stream = self.transports[self.killed]
            control.kill()  # its will says it left, as a crashed server's does
            stream.close()


def test_a_chain_that_loses_a_server_moves_its_back_onto_the_servers_left(
    tmp_path: Path, store: RunStore, profile: ModelProfile
) -> None:
    problem = Problem.build(profile, PartitionConfig(batch_size=16, optimizer="adam"))
    last = profile.num_blocks
    middle = min(range(2, last), key=lambda m: max(problem.memory[1][m], problem.memory[m][last]))
    room = int(max(problem.memory[1][middle], problem.memory[middle][last])) + 1024
    hub = InProcessHub()
    names = ("gpu-a", "gpu-b", "gpu-c")
    transports = {
        n: (hub.connect(f"{n}-control", node_will(node_id_for(n), n)), hub.connect(f"{n}-stream"))
        for n in names
    }
    for name, (control, stream) in transports.items():
        GpuAgent(Announcement(name, "gpu", room, 1e9), control, stream)
    devices = {"edges": list(EDGES), "gpu_servers": 3, "wait": "30s"}
    run = config(tmp_path, rounds=3, devices=devices)  # writes the edges' data
    start_fleet(hub, tmp_path, dict.fromkeys(EDGES, int(problem.edge_memory[1]) + 1024), {}, ())
    killer = _KillAfterRound(store, transports)
    coordinator = Coordinator(
        run, store, hub.connect("coordinator"), profile=lambda _: profile, observer=killer
    )

    assert coordinator.run() == 3

    rounds = store.list_rounds("svc-1")
    assert [r.state for r in rounds] == ["committed"] * 3
    plan = store.get_run("svc-1").plan
    assert plan is not None
    pieces = sorted((tuple(s["blocks"]), s["name"]) for s in plan["servers"])
    assert killer.killed and killer.killed not in {name for _, name in pieces}, pieces
    assert pieces[0][0][0] == 1 and pieces[-1][0][1] == last, pieces
    assert all(a[0][1] == b[0][0] for a, b in itertools.pairwise(pieces)), pieces
    moved = [e for e in store.events("svc-1") if e.kind == "replanned"]
    assert len(moved) == 1 and killer.killed in moved[0].detail, moved
    results = {r.device: r for r in rounds[-1].results}
    edge_examples = sum(results[e].examples for e in EDGES)
    assert all(results[name].examples == edge_examples for _, name in pieces), results
    # status counts each round's servers apart, the one the current plan left out included
    status = run_status(store, "svc-1")
    for summary in status["rounds"]:
        assert sorted(summary["participants"]) == sorted(EDGES), summary
    assert killer.killed in status["rounds"][0]["servers"]
