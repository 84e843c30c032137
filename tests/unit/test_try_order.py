"""A train message's try and the batch order it draws (``wire.flower``)."""

from __future__ import annotations

import pytest
from flwr.app import ConfigRecord, Message, RecordDict

from wire.errors import WireError
from wire.flower import TransportGrid, attempt_of, order_of
from wire.transport import InProcessHub

pytestmark = pytest.mark.unit


def _train(**config: object) -> Message:
    TransportGrid(InProcessHub().connect("coordinator"))  # Flower's identity, as a run sets it
    record = ConfigRecord({"server-round": 2, **config})  # type: ignore[dict-item]
    return Message(RecordDict({"config": record}), dst_node_id=1, message_type="train")


def test_a_try_redone_keeps_its_order_and_an_old_coordinator_s_try_is_its_order() -> None:
    assert (attempt_of(_train(attempt=3, order=1)), order_of(_train(attempt=3, order=1))) == (3, 1)
    assert order_of(_train(attempt=2)) == 2  # sent by a coordinator without orders
    assert order_of(_train()) == 1


@pytest.mark.parametrize("value", [0, 1000, True, 1.5, "2"])
def test_an_order_out_of_range_is_refused_naming_it(value: object) -> None:
    with pytest.raises(WireError, match="order must be an integer in \\[1, 999\\]"):
        order_of(_train(attempt=1, order=value))


def test_a_rounds_step_bound_is_read_and_a_bad_one_refused_naming_it() -> None:
    from wire.flower import max_step_of

    assert max_step_of(_train()) is None
    assert max_step_of(_train(**{"max-step": 0.05})) == 0.05
    for value in (0, -1.0, 1e4, float("nan"), True, "0.05"):
        with pytest.raises(WireError, match="max-step must be a number in"):
            max_step_of(_train(**{"max-step": value}))


def test_an_edge_is_bounded_in_its_first_round_at_a_new_cut_only() -> None:
    from coordinator.moves import MovedEdges
    from split_models.config import TrainingConfig

    moves = MovedEdges(TrainingConfig(rounds=3))  # server_max_step 0.05 by default
    assert moves.options("pi-01", (0, 2, 2)) == {}  # never trained here: nothing known
    moves.trained_at({"pi-01": (0, 2, 2), "pi-02": (0, 2, 2)}, ["pi-01"])
    assert moves.options("pi-01", (0, 2, 2)) == {}
    assert moves.options("pi-01", (0, 4, 4)) == {"max-step": 0.05}
    assert moves.options("pi-02", (0, 4, 4)) == {}, "pi-02 did not train"
    moves.trained_at({"pi-01": (0, 4, 4)}, ["pi-01"])
    assert moves.options("pi-01", (0, 4, 4)) == {}
    assert MovedEdges(TrainingConfig(rounds=3, server_max_step=None)).bound is None
