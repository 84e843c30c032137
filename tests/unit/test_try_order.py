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
