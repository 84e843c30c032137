"""Segment sources: what an edge agent trains a round with, its own segment by default or one
lent by a simulation host's pool (borrowed, or a slot of a stack), always loaded with the
round's weights and a fresh optimizer state."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch

from edge_client.source import OwnSegment, SegmentSource
from simulation.pool import SegmentPool, StackMember, Turns
from split_models import OptimizerConfig, Segment, build_model
from split_models.weights import segment_state

pytestmark = pytest.mark.unit


def _build(seed: int = 0) -> Segment:
    model = build_model("mlp", (1, 28, 28), 10, seed=seed)
    return Segment.from_model(model, 0, 1, "linear", OptimizerConfig("sgd-momentum"))


def _weights() -> dict[str, np.ndarray]:
    return segment_state(_build(seed=7))


def _round(source: SegmentSource, key: str, stackable: bool = False) -> tuple[object, bool]:
    """A step in a lease; the lease, and whether the step started from the round's weights
    with a fresh optimizer state (it equals that step on a segment built with them)."""
    inputs = torch.from_numpy(np.random.default_rng(1).normal(size=(4, 1, 28, 28)))
    inputs, labels = inputs.float(), torch.arange(4)
    reference = _build(seed=7)
    reference.train_step(inputs, labels)
    with source.lease(key, _build, _weights(), stackable) as lease:
        fresh = not lease.segment.optimizer.state
        lease.train_step(inputs, labels)
        trained = lease.state()
    expected = segment_state(reference)
    same = all(np.allclose(v, expected[k], atol=1e-5) for k, v in trained.items())
    return lease, fresh and same


def test_an_agents_own_segment_is_kept_per_task_and_loaded_each_round() -> None:
    source = OwnSegment()
    first, ready = _round(source, "a")
    again, ready_again = _round(source, "a")
    other, _ = _round(source, "b")
    assert ready and ready_again, "each round starts from its weights, optimizer state cleared"
    assert first.segment is again.segment  # type: ignore[attr-defined]
    assert other.segment is not first.segment  # type: ignore[attr-defined]


def test_a_pool_lends_borrowed_segments_or_stack_slots() -> None:
    borrowed, ready = _round(SegmentPool(1), "a", stackable=True)
    stacked, stacked_ready = _round(SegmentPool(1, stacked=True, capacity=2), "a", stackable=True)
    unstacked, _ = _round(SegmentPool(1, stacked=True, capacity=2), "a", stackable=False)
    assert ready and stacked_ready
    assert isinstance(stacked, StackMember) and not isinstance(borrowed, StackMember)
    assert not isinstance(unstacked, StackMember), "backprop rounds never train stacked"


def test_a_pool_hands_its_slots_to_the_rounds_clients_in_name_order() -> None:
    pool: SegmentPool[str] = SegmentPool(1)
    pool.turns.patience = 0.3
    pool.expect(["c", "a", "b", "absent"])
    order: list[str] = []

    def client(name: str) -> None:
        with pool.borrow("key", lambda: "built", holder=name):
            order.append(name)
            time.sleep(0.4)  # longer than turn_wait: a client ahead that trains is waited for

    threads = [threading.Thread(target=client, args=(n,)) for n in ("b", "c", "a")]
    for thread in threads:
        thread.start()
        time.sleep(0.05)
    for thread in threads:
        thread.join(10)
    assert order == ["a", "b", "c"]
    started = time.monotonic()
    pool.expect(["absent", "z"])
    client("z")  # 'absent' never asks: passed after turn_wait
    assert order[-1] == "z" and 0.25 < time.monotonic() - started < 2


def test_a_silent_client_is_passed_over_once_and_the_rest_keep_their_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    turns = Turns(0.3)
    turns.expect(["a", "b", "c", "d"])  # 'a' never asks
    order: list[str] = []

    def client(name: str) -> None:
        turns.wait(name)
        order.append(name)
        turns.took(name)

    threads = [threading.Thread(target=client, args=(n,)) for n in ("d", "c", "b")]
    with caplog.at_level(logging.WARNING, logger="simulation.pool"):
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
    assert order == ["b", "c", "d"]
    passed = [r for r in caplog.records if "did not ask" in r.getMessage()]
    assert len(passed) == 1 and passed[0].getMessage().startswith("a ")
