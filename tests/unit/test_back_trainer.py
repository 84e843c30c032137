"""A GPU server's trainer over the in-process transport: a chain piece counts each attempt of
a round afresh, an empty batch is rejected before training, and only the round's senders move
it."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from gpu_server import BackTrainer
from split_models import build_model
from wire import topics
from wire.channel import Channel
from wire.codec import Envelope
from wire.flow import CreditGranter
from wire.transport import InProcessHub

pytestmark = pytest.mark.unit

RUN, EDGE, GPU = "r1", "pi-01", "gpu-a"


def _until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _piece(hub: InProcessHub, forward: str | None = "seg-1", max_rows: int = 0) -> BackTrainer:
    """Blocks [1, 2) of an MLP (a chain piece passing on to ``forward``) or [1, 4)."""
    return BackTrainer(
        Channel(hub.connect(GPU), GPU),
        build_model("mlp", (1, 4, 4), 10, seed=0),
        start=1,
        run=RUN,
        segment="seg-0",
        end=2 if forward is not None else None,
        forward=forward,
        max_rows=max_rows,
    )


def _send(
    edge: Channel,
    round_number: int,
    rows: int = 2,
    sender: str = EDGE,
    attempt: int = 1,
    **meta: object,
) -> None:
    rng = np.random.default_rng(round_number)
    edge.send(
        topics.activations(RUN, "seg-0", sender),
        "activations",
        RUN,
        round=round_number,
        tensors={
            "x": rng.normal(size=(rows, 1024)).astype(np.float32),
            "y": rng.integers(0, 10, size=rows).astype(np.int64),
        },
        meta={"cut": 1, "attempt": attempt, **meta},
    )


def _done(edge: Channel, round_number: int, batches: int, attempt: int = 1) -> None:
    edge.send(
        topics.done(RUN, edge.sender),
        "round_control",
        RUN,
        round=round_number,
        meta={"batches": batches, "attempt": attempt},
    )


def _next_begins(following: Channel, round_number: int, attempt: int = 1) -> None:
    """The next piece of the chain begins try ``attempt`` of the round: its first credit to
    the piece (without it the piece waits a minute before passing batches on)."""
    granter = CreditGranter(following, RUN, window=1)
    granter.attempt = attempt
    granter.open(GPU, round_number)


def test_a_retried_round_of_a_chain_piece_counts_its_batches_afresh() -> None:
    hub = InProcessHub()
    back = _piece(hub)
    published: list[Envelope] = []
    following = Channel(hub.connect("next"), "next")
    following.listen(
        topics.done(RUN, GPU), lambda _t, e: published.append(e), kinds=frozenset({"round_control"})
    )
    edge = Channel(hub.connect(EDGE), EDGE)
    for attempt, attempt_batches in enumerate((3, 2), 1):  # the runner retries round 1
        _next_begins(following, 1, attempt)
        back.begin_round(1, [EDGE], attempt=attempt)
        for _ in range(attempt_batches):
            _send(edge, 1, attempt=attempt)
        _done(edge, 1, attempt_batches, attempt)
        assert back.stream.wait_round(5.0)
        assert _until(lambda n=attempt: len(published) == n)
    assert [e.meta["batches"] for e in published] == [3, 2], "attempt 2 passed on 2, not 5"


def test_a_chain_piece_numbers_the_batches_it_passes_on() -> None:
    # the next piece counts distinct batches by their numbers (docs/wire.md, "Counting"):
    # unnumbered, every batch read as the same one ("batches=64 distinct=1")
    hub = InProcessHub()
    back = _piece(hub)
    passed: list[Envelope] = []
    following = Channel(hub.connect("next"), "next")
    following.listen(
        topics.activations(RUN, "seg-1", GPU),
        lambda _t, e: passed.append(e),
        kinds=frozenset({"activations"}),
    )
    edge = Channel(hub.connect(EDGE), EDGE)
    for number in (1, 2):
        _next_begins(following, number)
        back.begin_round(number, [EDGE])
        for _ in range(3):
            _send(edge, number)
        _done(edge, number, 3)
        assert back.stream.wait_round(5.0)
        assert _until(lambda n=number: len(passed) == 3 * n)
    assert [(e.round, e.meta["batch"]) for e in passed] == [
        (r, b) for r in (1, 2) for b in range(3)
    ]


def test_an_empty_batch_is_rejected_not_trained() -> None:
    hub = InProcessHub()
    back = _piece(hub, forward=None)
    edge = Channel(hub.connect(EDGE), EDGE)
    back.begin_round(1, [EDGE])
    _send(edge, 1, rows=0)
    _send(edge, 1)
    _done(edge, 1, 2)
    examples, loss = back.wait_round([EDGE], 5.0)
    assert back.finished == {EDGE}, "the rejected batch still counts as handled"
    assert back.stats.rejected["shape"] == 1 and back.stats.batches == 1
    assert examples == 2 and np.isfinite(loss), "no NaN loss from a batch of zero rows"


def test_a_batch_above_the_runs_batch_size_is_rejected_not_trained() -> None:
    """A device may send a well-formed batch of thousands of rows: the server's memory plan
    is for batch_size, and the examples it trains weigh the sender's update."""
    hub = InProcessHub()
    back = _piece(hub, forward=None, max_rows=4)
    edge = Channel(hub.connect(EDGE), EDGE)
    back.begin_round(1, [EDGE])
    _send(edge, 1, rows=400)
    _send(edge, 1, rows=6)
    _send(edge, 1, rows=5)  # an epoch's last batch of one joins the one before it
    _done(edge, 1, 3)
    examples, _ = back.wait_round([EDGE], 5.0)
    assert back.stats.rejected["shape"] == 2 and back.stats.batches == 1
    assert examples == 5, "the oversized batches' rows count for nothing"


def test_a_batch_whose_handling_raises_is_rejected_and_the_round_still_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    hub = InProcessHub()
    back = _piece(hub, forward=None)
    edge = Channel(hub.connect(EDGE), EDGE)
    back.begin_round(1, [EDGE])
    _send(edge, 1, batch=[1, 2])  # the sender's batch number is any JSON it writes
    assert _until(lambda: back.stats.batches == 1)
    counted = back._trained

    def unforeseen(*args: object) -> None:
        monkeypatch.setattr(back, "_trained", counted)  # once
        raise RuntimeError("a bug, or a device-side assert")

    monkeypatch.setattr(back, "_trained", unforeseen)
    _send(edge, 1)
    _send(edge, 1)
    _done(edge, 1, 3)

    examples, _ = back.wait_round([EDGE], 5.0)
    assert back.finished == {EDGE}, "the batch that raised still counts as handled"
    assert back.stats.rejected["error"] == 1
    assert examples == 4
