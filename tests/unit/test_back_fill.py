"""A GPU server fills its local-loss steps from several senders' small batches: every
example is trained once and counted for its sender, a full batch trains alone, batches of
different cuts never share a step, and one sender's bad batch costs the others nothing."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpu_server import BackTrainer
from gpu_server.stage import Fill, Part
from split_models import build_model
from split_models.segment import StepResult
from wire.channel import Channel
from wire.codec import Envelope
from wire.errors import WireError
from wire.transport import InProcessHub

from .test_back_trainer import GPU, RUN, _done, _send

pytestmark = pytest.mark.unit

SENDERS = [f"pi-{i:02d}" for i in range(5)]


def _part(cut: int, rows: int, sender: str = "a") -> Part:
    envelope = Envelope("activations", RUN, sender, 0, 1, {"cut": cut}, {})
    return Part(envelope, cut, [torch.zeros(rows, 3)], torch.zeros(rows, dtype=torch.int64))


def test_a_fill_groups_small_batches_by_cut_and_lets_a_full_batch_go_alone() -> None:
    fill = Fill(8)
    sizes = [[p.rows for p in g] for p in (_part(1, 8),) for g in fill.add(p)]
    assert sizes == [[8]]  # a full batch: at once, alone
    ready = [fill.add(_part(1, 3)), fill.add(_part(2, 3)), fill.add(_part(1, 3))]
    assert ready == [[], [], []]  # 6 rows of cut 1, 3 of cut 2 held
    flushed = fill.add(_part(1, 3))  # 9 > 8: the 6 held go, the 3 new wait
    assert [[p.rows for p in g] for g in flushed] == [[3, 3]]
    assert {g[0].cut: [p.rows for p in g] for g in fill.take()} == {1: [3], 2: [3]}
    assert fill.take() == []


def _fleet(fill: int) -> tuple[BackTrainer, list[Channel]]:
    hub = InProcessHub()
    back = BackTrainer(
        Channel(hub.connect(GPU), GPU),
        build_model("mlp", (1, 4, 4), 10, seed=0),
        start=1,
        run=RUN,
        segment="seg-0",
        fill=fill,
    )
    return back, [Channel(hub.connect(s), s) for s in SENDERS]


def _round(back: BackTrainer, edges: list[Channel]) -> tuple[int, float]:
    back.begin_round(1, SENDERS)
    for edge in edges:
        _send(edge, 1, rows=2, sender=edge.sender)
        _done(edge, 1, 1)
    return back.wait_round(SENDERS, 10.0)


def test_small_batches_of_many_senders_share_steps_and_each_example_counts_once() -> None:
    back, edges = _fleet(fill=4)
    steps: list[list[str]] = []
    train_parts = back.stage.train_parts

    def spy(parts: list[Part]) -> StepResult:
        steps.append([p.envelope.sender for p in parts])
        return train_parts(parts)

    back.stage.train_parts = spy  # type: ignore[method-assign]
    examples, loss = _round(back, edges)
    assert examples == 10 and np.isfinite(loss)
    assert sorted(s for step in steps for s in step) == SENDERS  # each batch trained once
    assert len(steps) == 3  # 2 + 2 rows a step, the last batch at the round's end
    assert back.round_senders() == {s: 2 for s in SENDERS}


def test_a_bad_batch_in_a_shared_step_is_rejected_alone() -> None:
    back, edges = _fleet(fill=100)  # every batch waits for the round's end: one shared step
    train_parts = back.stage.train_parts

    def poisoned(parts: list[Part]) -> StepResult:
        if any(p.envelope.sender == "pi-02" for p in parts):
            raise WireError("non_finite", "batch not trained: the loss is NaN")
        return train_parts(parts)

    back.stage.train_parts = poisoned  # type: ignore[method-assign]
    examples, _ = _round(back, edges)
    assert examples == 8
    assert back.round_senders() == {s: 2 for s in SENDERS if s != "pi-02"}
    assert back.stats.rejected["non_finite"] == 1
