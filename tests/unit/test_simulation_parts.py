"""Pure parts of the simulation and the coordinator's routing: the segment pool, the stream
layout of chained GPU servers, availability draws, simulated time and the progress display."""

from __future__ import annotations

import io
import threading
import time
from dataclasses import dataclass

import pytest
from rich.console import Console

from coordinator.assignments import Assignment, route
from simulation.config import Availability, FleetConfig, Profile
from simulation.pool import SegmentPool
from simulation.progress import RoundProgress
from simulation.report import simulated_round_seconds
from split_models.plan import EdgeAssignment

pytestmark = pytest.mark.unit


def test_pool_builds_once_per_worker_and_bounds_concurrency() -> None:
    pool: SegmentPool[object] = SegmentPool(2)
    running, most = 0, 0
    lock = threading.Lock()

    def client() -> None:
        nonlocal running, most
        with pool.borrow("task", object):
            with lock:
                running += 1
                most = max(most, running)
            time.sleep(0.01)
            with lock:
                running -= 1

    threads = [threading.Thread(target=client) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert most == 2
    assert pool.built == 2  # twelve clients, two built objects


def test_pool_keeps_tasks_apart_and_rejects_no_workers() -> None:
    pool: SegmentPool[list[str]] = SegmentPool(1)
    with pool.borrow("a", lambda: ["a"]) as first:
        pass
    with pool.borrow("b", lambda: ["b"]) as second:
        pass
    with pool.borrow("a", lambda: ["new"]) as again:
        pass
    assert (first, second, again) == (["a"], ["b"], ["a"]) and again is first
    with pytest.raises(ValueError, match="workers"):
        SegmentPool(0)


def _edge(name: str, cut: int) -> Assignment:
    return Assignment(name, 0, cut, 0, "edge")


def _gpu(name: str, start: int, end: int) -> Assignment:
    return Assignment(name, start, end, 0, "gpu")


def test_route_of_shared_servers_is_one_stream() -> None:
    streams, routes = route([_edge("e1", 1), _edge("e2", 3)], [_gpu("g1", 1, 6), _gpu("g2", 1, 6)])
    assert streams == {"e1": "seg-0", "e2": "seg-0"}
    assert routes["g1"] == (["e1", "e2"], ["g1", "g2"], "seg-0", None)
    assert routes["g2"] == (["e1", "e2"], ["g1", "g2"], "seg-0", None)


def test_route_of_a_chain_feeds_each_piece_its_cuts_and_the_piece_before() -> None:
    servers = [_gpu("g1", 1, 3), _gpu("g2", 3, 5), _gpu("g3", 5, 7)]
    streams, routes = route([_edge("e1", 1), _edge("e2", 4)], servers)
    assert streams == {"e1": "seg-0", "e2": "seg-1"}
    assert routes["g1"] == (["e1"], ["g1"], "seg-0", "seg-1")
    assert routes["g2"] == (["e2", "g1"], ["g2"], "seg-1", "seg-2")
    assert routes["g3"] == (["g2"], ["g3"], "seg-2", None)
    # nobody streams into the first piece: it hears no one and passes nothing on
    _, routes = route([_edge("e2", 4)], servers)
    assert routes["g1"][0] == [] and routes["g2"][0] == ["e2"]


def test_availability_draws_are_seeded_and_follow_the_trace() -> None:
    names = [f"c{i}" for i in range(200)]
    draws = Availability(online=0.75)
    offline = draws.offline_in(1, names, seed=0)
    assert offline == draws.offline_in(1, names, seed=0)
    assert offline != draws.offline_in(2, names, seed=0)
    assert 30 <= len(offline) <= 70  # about a quarter of 200
    trace = Availability(offline={"c1": (2,)})
    assert trace.offline_in(1, names, 0) == set() and trace.offline_in(2, names, 0) == {"c1"}


def test_clients_take_the_device_profiles_by_share_in_order() -> None:
    small, large = Profile("small", 0.25, 1, 1.0), Profile("large", 0.75, 2, 2.0)
    fleet = FleetConfig(clients=4, devices=(small, large))
    profiles = fleet.client_profiles()
    assert list(profiles) == ["client-000", "client-001", "client-002", "client-003"]
    assert [p.name for p in profiles.values()] == ["small", "large", "large", "large"]
    assert {p.name for p in FleetConfig(clients=1).client_profiles().values()} == {"large"}


def test_grouped_hosts_are_numbered_without_gaps_when_a_profile_draws_no_client() -> None:
    tiny, small, large = (Profile(n, s, 1, 1.0) for n, s in [("a", 0.4), ("b", 0.1), ("c", 0.5)])
    fleet = FleetConfig(clients=2, devices=(tiny, small, large), group_clients=True)
    hosts = fleet.hosts()

    assert {name: (p.name, clients) for name, (p, clients) in hosts.items()} == {
        "host-0": ("a", ["client-000"]),
        "host-1": ("c", ["client-001"]),
    }
    assert list(fleet.device_profiles()) == ["host-0", "host-1"]


@dataclass
class _Result:
    device: str
    examples: int
    failure: str | None = None


@dataclass
class _Profile:
    flops: float
    uplink: float


def test_simulated_time_overlaps_in_local_loss_and_adds_up_in_splitfed() -> None:
    edges = {"a": EdgeAssignment("a", (0, 2), 0, 0, 1000, 1_000_000, 0.0)}
    profiles = {"a": _Profile(flops=3e8, uplink=1e5)}  # compute 1 s, upload 1 s per 100 samples
    results = [_Result("a", 100), _Result("b", 100), _Result("a", 100, failure="offline")]
    assert simulated_round_seconds(results, edges, profiles, backprop=False) == pytest.approx(1.0)
    assert simulated_round_seconds(results, edges, profiles, backprop=True) == pytest.approx(3.0)
    # 25 kB of weights come down and go back up at 100 kB/s: half a second more a round
    heavy = {"a": EdgeAssignment("a", (0, 2), 0, 0, 1000, 1_000_000, 0.0, weight_bytes=25_000)}
    assert simulated_round_seconds(results, heavy, profiles, backprop=False) == pytest.approx(1.5)
    assert simulated_round_seconds(results, heavy, profiles, backprop=True) == pytest.approx(3.5)


def test_progress_prints_a_line_per_round_without_a_terminal() -> None:
    buffer = io.StringIO()
    progress = RoundProgress(2, "test", Console(file=buffer, force_terminal=False))
    with progress:
        progress.round_started(1, ["a", "b"])
        progress.device_answered("a")
        progress.device_answered("b")
        results = [_Result("a", 10), _Result("gpu-a", 10)]
        progress.round_committed(1, {"accuracy": 0.5, "loss": 1.25}, results, servers=["gpu-a"])
    assert "round 1/2: accuracy 0.5000, loss 1.2500, 1/1 clients trained" in buffer.getvalue()
    # the minute a first model's profile takes was silent in a log
    assert buffer.getvalue().startswith("test: profiling the model and planning the cuts, then 2")


def test_progress_says_of_how_many_a_round_trained_when_it_sent_work_to_fewer() -> None:
    buffer = io.StringIO()  # two of four clients offline, say
    with RoundProgress(2, "test", Console(file=buffer, force_terminal=False), fleet=4) as live:
        live.round_committed(1, {"accuracy": 0.5, "loss": 1.25}, [_Result("a", 10)] * 2)
        live.round_committed(2, {"accuracy": 0.5, "loss": 1.25}, [_Result("a", 10)] * 4)
    assert "2/2 of 4 clients trained" in buffer.getvalue()
    assert "4/4 clients trained" in buffer.getvalue()


def test_progress_shows_the_federated_evaluation_where_the_run_measures_it() -> None:
    results = [_Result("a", 10)]
    evaluation = {"accuracy": 0.5, "loss": 1.25, "federated_accuracy": 0.625}
    buffer = io.StringIO()
    with RoundProgress(2, "test", Console(file=buffer, force_terminal=False)) as progress:
        progress.round_committed(1, evaluation, results)
    assert (
        "round 1/2: accuracy 0.5000, on the edges' data 0.6250, loss 1.2500, 1/1 clients trained"
        in buffer.getvalue()
    ), "one line, not wrapped at 80 columns"
    screen = io.StringIO()
    with RoundProgress(2, "test", Console(file=screen, force_terminal=True, width=120)) as live:
        live.round_committed(1, {"accuracy": 0.5, "loss": 1.25}, results)  # before it was on
        live.round_committed(2, evaluation, results)
    assert "federated accuracy" in screen.getvalue() and "0.6250" in screen.getvalue()


@pytest.mark.parametrize(("method", "noted"), [("splitfed", True), ("fedavg", False)])
def test_the_summary_says_how_many_clients_took_no_part(
    method: str, noted: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """Clients too small for any segment are left out with a warning at the start; the end
    of a long run says it again, beside the accuracy it qualifies."""
    from simulation.command import _print_summary

    def client(name: str, blocks: list[int] | None) -> dict[str, object]:
        return {"name": name, "profile": "p", "blocks": blocks, "budget_bytes": 1 << 20}

    summary = {
        "run_id": "sim-1",
        "method": method,
        "final_accuracy": 0.5,
        "total_wall_seconds": 1.0,
        "total_simulated_seconds": 1.0,
        "rounds": [],
        "clients": [
            {**client("client-000", None), "estimated_peak_bytes": None, "examples": 0},
            {**client("client-001", [0, 2]), "estimated_peak_bytes": 1 << 19, "examples": 9},
        ],
    }
    _print_summary(summary, "out")
    printed = capsys.readouterr().out
    note = "note: 1 of 2 clients took no part: no plan gave them blocks (their memory or"
    assert (note in printed) is noted


def test_a_baseline_names_the_split_keys_it_ignores() -> None:
    """centralized with krum, Dirichlet, uniform cuts and int8 gave the plain centralized
    figures without a word."""
    from simulation.baselines import ignored_by_baseline
    from simulation.config import parse_sim_config

    central = {
        "method": "centralized",
        "strategy": {"name": "krum"},
        "partition": {"kind": "dirichlet", "alpha": 0.5},
        "cuts": "uniform",
        "compression": "int8",
    }
    assert ignored_by_baseline(parse_sim_config(central)) == [
        "cuts",
        "compression",
        "partition",
        "strategy",
    ]
    fedavg = central | {"method": "fedavg"}  # its clients are split and averaged
    assert ignored_by_baseline(parse_sim_config(fedavg)) == ["cuts", "compression"]
    assert ignored_by_baseline(parse_sim_config({"method": "fedavg"})) == []


def test_a_plan_the_gpu_server_cannot_hold_points_at_the_gpu_section() -> None:
    """It pointed at the clients' memory, which had nothing to do with it."""
    from simulation.command import _devices_hint
    from simulation.config import parse_sim_config
    from split_models.errors import InfeasiblePlanError, ServersTooSmall

    config = parse_sim_config({"gpu": {"memory": "10KiB"}})
    servers = r"gpu: section \(memory 10.0 KiB\)"
    with pytest.raises(ServersTooSmall, match=servers) as raised, _devices_hint(config):
        raise ServersTooSmall("the GPU servers cannot hold the back of the model")
    assert "clients" not in str(raised.value)
    edges = r"profiles of SIM\.yaml's devices"
    with pytest.raises(InfeasiblePlanError, match=edges), _devices_hint(config):
        raise InfeasiblePlanError("edge client-000 cannot hold blocks [0, 1)")
