"""The coordinator's side of a run's lease: who takes it over, who is refused, and when."""

from __future__ import annotations

import socket
import subprocess
import sys
from datetime import timedelta

import pytest

from coordinator.errors import RunHeldError
from coordinator.lease import RunLease
from coordinator.stopping import request_stop
from split_models.errors import ConfigError
from storage import Event, InMemoryRunStore, Lease, LeaseLostError
from storage.records import utcnow

pytestmark = pytest.mark.unit


class FakeTime:
    """A clock that ``sleep`` moves, with something to do at each sleep."""

    def __init__(self) -> None:
        self.now, self.slept, self.on_sleep = 0.0, 0, lambda: None

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds
        self.slept += 1
        self.on_sleep()


def other(host: str, pid: int = 4242, age: float = 0.0, ttl: float = 30.0) -> Lease:
    then = utcnow() - timedelta(seconds=age)
    return Lease("r", "other", host, pid, ttl, then, then)


def newcomer(store: InMemoryRunStore, time: FakeTime, alive: bool = True) -> RunLease:
    return RunLease(store, "r", clock=time.clock, sleep=time.sleep, alive=lambda _: alive)


def test_a_free_run_is_taken_and_given_back() -> None:
    store, time = InMemoryRunStore(), FakeTime()
    with newcomer(store, time) as lease:
        held = store.lease("r")
        assert held is not None and held.holder == lease.holder and held.pid == lease.pid
        assert store.fenced("r") == lease.holder and lease.replaced is None
    assert store.lease("r") is None and store.fenced("r") is None and time.slept == 0


def test_a_killed_coordinator_on_this_host_is_taken_over_at_once() -> None:
    store, time = InMemoryRunStore(), FakeTime()
    store.claim_lease(other(socket.gethostname()))
    lease = newcomer(store, time, alive=False).acquire()
    try:
        assert lease.replaced is not None and lease.replaced.holder == "other"
        held = store.lease("r")
        assert held is not None and held.holder == lease.holder and time.slept == 0
    finally:
        lease.release()


def test_a_live_process_on_this_host_is_not_taken_over_by_its_pid() -> None:
    store, time = InMemoryRunStore(), FakeTime()
    store.claim_lease(other(socket.gethostname()))
    time.on_sleep = lambda: store.renew_lease("r", "other") if time.slept == 3 else None
    with pytest.raises(RunHeldError, match=r"another coordinator \(pid 4242 .* renewed"):
        newcomer(store, time, alive=True).acquire()
    held = store.lease("r")
    assert held is not None and held.holder == "other"


def test_a_coordinator_elsewhere_that_renews_is_alive() -> None:
    store, time = InMemoryRunStore(), FakeTime()
    store.claim_lease(other("elsewhere"))
    time.on_sleep = lambda: store.renew_lease("r", "other") if time.slept == 2 else None
    with pytest.raises(RunHeldError, match=r"elsewhere.*stop that one first"):
        newcomer(store, time, alive=False).acquire()  # its pid says nothing: another host
    assert time.slept == 2  # refused at the first renewal seen, not after the ttl


def test_a_silent_coordinator_elsewhere_is_taken_over_once_its_lease_expires() -> None:
    store, time = InMemoryRunStore(), FakeTime()
    store.claim_lease(other("elsewhere", age=29.0))
    expired = other("elsewhere", age=31.0)

    def age() -> None:  # one real second later, as the clock moved
        held = store.lease("r")
        if held is not None and held.holder == "other":
            store._leases["r"] = expired

    time.on_sleep = age
    lease = newcomer(store, time).acquire()
    try:
        assert lease.replaced is not None and lease.replaced.host == "elsewhere"
        assert time.slept == 1
    finally:
        lease.release()


def test_a_silent_holder_that_outlasts_the_wait_is_refused() -> None:
    store, time = InMemoryRunStore(), FakeTime()
    store.claim_lease(other("elsewhere", ttl=1e6))  # a clock far off: it never expires here
    with pytest.raises(RunHeldError, match="did not expire in 5 s"):
        newcomer(store, time).acquire(wait=5.0)
    assert time.now >= 5.0


def test_a_lease_taken_over_stops_its_coordinator_and_its_commits() -> None:
    store = InMemoryRunStore()
    store.create_run("r", {}, seed=0)
    lease = RunLease(store, "r", ttl=1.0).acquire()
    mine = store.lease("r")
    assert mine is not None
    lease._closed.set()  # as if the coordinator froze: no more renewals
    assert lease._thread is not None
    lease._thread.join()
    store.open_round("r", 1, ["a"])
    assert store.claim_lease(other("elsewhere"), replacing=store.lease("r"))
    with pytest.raises(LeaseLostError, match="taken over"):
        store.commit_round("r", 1, {"s": {}})
    for write in (
        lambda: store.open_round("r", 2, ["a"]),
        lambda: store.set_run_status("r", "cancelled"),
        lambda: store.add_event("r", Event("cancelled", "by a coordinator gone")),
    ):
        with pytest.raises(LeaseLostError):
            write()
    assert store.get_run("r").status == "created" and store.events("r") == []
    lease._closed.clear()
    lease._renew_once()
    assert lease.lost.is_set()
    with pytest.raises(LeaseLostError, match="elsewhere"):
        lease.check()
    lease.release()
    held = store.lease("r")
    assert held is not None and held.holder == "other"  # a lost lease is not given up


def test_a_lease_needs_a_sensible_ttl() -> None:
    for ttl in (0.0, 0.5, 1e5):
        with pytest.raises(ConfigError, match="--lease-seconds: expected 1 to 3600 s"):
            RunLease(InMemoryRunStore(), "r", ttl=ttl)


def test_runs_stop_cancels_at_once_a_run_whose_coordinator_here_is_gone() -> None:
    store = InMemoryRunStore()
    store.create_run("r", {}, seed=0)
    store.set_run_status("r", "training")
    store.claim_lease(other(socket.gethostname(), pid=_dead_pid()))

    def no_sleep(_: float) -> None:
        raise AssertionError("waited for an answer nobody can give")

    said = request_stop(store, "r", sleep=no_sleep)

    assert said == "run r is cancelled (no coordinator was driving it)"
    assert store.get_run("r").status == "cancelled"


def _dead_pid() -> int:
    """The pid of a process that has ended."""
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid
