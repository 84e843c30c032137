"""The simulation's turns by step (simulation.pace) and the segment pool that holds a segment
per client for an interleaved round."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import pytest

import simulation.pool as pool_module
from simulation.pace import Pacer
from simulation.pool import SegmentPool

pytestmark = pytest.mark.unit


def _clients(
    pacer: Pacer,
    batches: dict[str, int],
    delays: dict[str, float] | None = None,
    during: Callable[[str], None] | None = None,
    joined: bool = False,
) -> list[str]:
    """Run each client's steps in its own thread (joining first, unless ``joined``, and
    leaving after); the order the steps were taken in."""
    taken: list[str] = []
    lock = threading.Lock()

    def client(name: str, count: int) -> None:
        time.sleep((delays or {}).get(name, 0.0))
        if not joined:
            pacer.join(name, count)
        for _ in range(count):
            with pacer.turn(name):
                with lock:
                    taken.append(name)
                if during is not None:
                    during(name)
        if not joined:
            pacer.leave(name)

    threads = [threading.Thread(target=client, args=item) for item in batches.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    return taken


def _shares(taken: Sequence[str], name: str, total: int) -> list[float]:
    """``name``'s share of its batches done after each step of anyone's."""
    done, shares = 0, []
    for who in taken:
        done += who == name
        shares.append(done / total)
    return shares


def test_clients_step_in_proportion_to_their_batches_in_one_order() -> None:
    pacer = Pacer(running=1)
    pacer.expect(["a", "b"])
    taken = _clients(pacer, {"a": 6, "b": 3})
    # the one further behind in its share steps next, ties by name
    assert taken == ["a", "b", "a", "a", "b", "a", "a", "b", "a"]
    again = Pacer(running=1)
    again.expect(["a", "b"])
    assert _clients(again, {"b": 3, "a": 6}) == taken  # threads started in another order
    gaps = np.abs(np.subtract(_shares(taken, "a", 6), _shares(taken, "b", 3)))
    assert gaps.max() <= 0.5  # never more than a step of b's apart


def test_no_step_before_the_expected_clients_joined() -> None:
    pacer = Pacer(running=1)
    pacer.expect(["a", "b"])
    taken = _clients(pacer, {"a": 4, "b": 4}, delays={"b": 0.3})
    assert taken[:2] == ["a", "b"]  # a waited for b: it did not train its round alone
    assert taken.count("a") == taken.count("b") == 4


def test_a_client_that_never_joins_is_waited_for_only_patience_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pacer = Pacer(running=1, patience=0.2)
    pacer.expect(["a", "ghost"])
    began = time.monotonic()
    with caplog.at_level(logging.DEBUG, logger="simulation.pace"):
        taken = _clients(pacer, {"a": 3})
    assert taken == ["a", "a", "a"] and time.monotonic() - began < 5
    assert "ghost did not start training within" in caplog.text


def test_a_client_that_stops_coming_back_does_not_hold_the_others() -> None:
    pacer = Pacer(running=1, patience=0.2)
    pacer.expect(["a", "b"])
    pacer.join("stuck", 10)  # joined, never steps (waiting for a credit that never came)
    began = time.monotonic()
    taken = _clients(pacer, {"a": 3, "b": 3})
    assert sorted(taken) == ["a"] * 3 + ["b"] * 3 and time.monotonic() - began < 5


def test_a_late_client_starts_level_with_the_others() -> None:
    pacer = Pacer(running=1)
    pacer.expect(["a"])
    pacer.join("a", 4)
    for _ in range(2):
        with pacer.turn("a"):
            pass
    pacer.join("late", 4)  # a is halfway: late starts there, not at zero
    taken = _clients(pacer, {"a": 2, "late": 4}, joined=True)
    assert taken[:3] == ["a", "late", "a"]  # not four of late's steps in a row


def test_at_most_running_steps_at_once() -> None:
    pacer = Pacer(running=2)
    pacer.expect(["a", "b", "c"])
    now, most = [0], [0]
    lock = threading.Lock()

    def during(name: str) -> None:
        with lock:
            now[0] += 1
            most[0] = max(most[0], now[0])
        time.sleep(0.02)
        with lock:
            now[0] -= 1

    taken = _clients(pacer, {"a": 4, "b": 4, "c": 4}, during=during)
    assert len(taken) == 12 and most[0] == 2
    with pytest.raises(ValueError, match="running"):
        Pacer(running=0)


def _weights(nbytes: int) -> dict[str, np.ndarray]:
    return {"w": np.zeros(nbytes // 4, dtype=np.float32)}


def test_pool_interleaves_held_segments_and_bounds_their_bytes(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(pool_module, "HELD_BYTES", 3 * 4 * 1024)  # room for three of 1 KiB x 4
    monkeypatch.setattr(pool_module.SegmentLease, "fresh", _fresh)
    pool: SegmentPool[object] = SegmentPool(1, interleave=True)
    holding, most = [0], [0]
    lock = threading.Lock()

    def client(name: str) -> None:
        with pool.lease("task", object, _weights(1024), holder=name) as lease:  # type: ignore[arg-type]
            assert lease.pace is not None
            lease.pace.begin(2)
            with lock:
                holding[0] += 1
                most[0] = max(most[0], holding[0])
            for _ in range(2):
                with lease.pace.turn():
                    time.sleep(0.01)
            with lock:
                holding[0] -= 1

    _run(pool, client, [f"c{i}" for i in range(5)])
    assert most[0] == 3 and pool.built == 3  # five clients, three held at once by bytes
    with pool.lease("task", object, _weights(1024), holder="x", ordered=True) as lease:  # type: ignore[arg-type]
        assert lease.pace is None  # deterministic runs train one client's round alone


def _pooled_order(monkeypatch: pytest.MonkeyPatch, delays: dict[str, float]) -> list[str]:
    """The order five clients of 3 batches step in, through a pool holding two at once,
    each client slow by ``delays`` to begin once it holds a segment (building it)."""
    monkeypatch.setattr(pool_module, "HELD_CLIENTS", 2)
    monkeypatch.setattr(pool_module.SegmentLease, "fresh", _fresh)
    pool: SegmentPool[object] = SegmentPool(1, interleave=True)
    taken: list[str] = []

    def client(name: str) -> None:
        with pool.lease("task", object, _weights(64), holder=name) as lease:  # type: ignore[arg-type]
            assert lease.pace is not None
            time.sleep(delays.get(name, 0.0))
            lease.pace.begin(3)
            for _ in range(3):
                with lease.pace.turn():
                    taken.append(name)
                    time.sleep(0.005)
            time.sleep(delays.get(name, 0.0))  # its round's wrap-up

    _run(pool, client, [f"c{i}" for i in range(5)])
    return taken


def test_more_clients_than_the_pool_holds_step_in_one_order_however_slow_each_is(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    orders = [
        _pooled_order(monkeypatch, delays)
        for delays in ({}, {"c0": 0.3}, {"c1": 0.2, "c2": 0.3}, {"c0": 0.1, "c3": 0.3})
    ]
    assert sorted(orders[0]) == sorted(f"c{i}" for i in range(5) for _ in range(3))
    assert orders[0][:2] == ["c0", "c1"], "the first two held start together"
    for order in orders[1:]:
        assert order == orders[0]


def _run(pool: SegmentPool[object], client: Callable[[str], None], names: list[str]) -> None:
    """``client(name)`` for each of the round's ``names``, each in its own thread."""
    pool.expect(names)
    threads = [threading.Thread(target=client, args=(name,)) for name in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)


def _fresh(segment: object, weights: object, proximal_mu: float = 0.0) -> pool_module.SegmentLease:
    return pool_module.SegmentLease(segment)  # type: ignore[arg-type]


def test_a_hosts_clients_take_turns_by_share_within_a_window() -> None:
    from simulation.hosts import in_turns

    lists = [["a0", "a1"], ["b0", "b1", "b2", "b3"], [], ["c0"]]
    assert in_turns(lists, 4) == ["a0", "b0", "c0", "b1", "a1", "b2", "b3"]
    assert in_turns(lists, 2) == ["a0", "b0", "b1", "a1", "b2", "b3", "c0"]  # c0 waits
    assert in_turns(lists, 1) == ["a0", "a1", "b0", "b1", "b2", "b3", "c0"]
