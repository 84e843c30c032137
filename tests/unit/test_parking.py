"""What a GPU server parks for a round it has not begun (a peer began it first) is bounded:
a device sent 40 MB batches for a round a million ahead, and the server grew by gigabytes
it never gave back."""

from __future__ import annotations

import numpy as np
import pytest

from wire.codec import Envelope
from wire.stream_records import ParkingLot

pytestmark = pytest.mark.unit


def _batch(sender: str, number: int, mib: int = 1) -> Envelope:
    x = np.zeros((mib, 1 << 18), np.float32)  # mib MiB
    return Envelope("activations", "run-1", sender, 0, number, tensors={"x": x})


def test_once_a_round_is_begun_only_the_next_one_parks() -> None:
    lot = ParkingLot(most=100, per_sender=10)
    assert lot.admit(3, 4, "pi-01", _batch("pi-01", 4))
    assert not lot.admit(3, 1_000_003, "pi-01", _batch("pi-01", 1_000_003)), "no peer's round"
    assert not lot.admit(3, 6, "pi-01", _batch("pi-01", 6))
    assert lot.admit(0, 9, "pi-01", _batch("pi-01", 9)), "a fresh server cannot tell"
    assert [p.number for p in lot.take(4)] == [4]
    assert len(lot) == 1  # round 9's waits


def test_parking_is_bounded_in_count_and_bytes_per_sender_and_in_all() -> None:
    lot = ParkingLot(most=5, per_sender=3, bytes_most=16 << 20)  # 4 MiB a sender
    assert all(lot.admit(1, 2, "pi-01", _batch("pi-01", 2, mib=1)) for _ in range(3))
    assert not lot.admit(1, 2, "pi-01", _batch("pi-01", 2, mib=1)), "3 a sender"
    assert not lot.admit(1, 2, "pi-02", _batch("pi-02", 2, mib=5)), "over a quarter of bytes"
    assert lot.admit(1, 2, "pi-02", _batch("pi-02", 2, mib=4))
    assert lot.admit(1, 2, "pi-03", None, (7, "non_finite")), "a rejection holds no bytes"
    assert not lot.admit(1, 2, "pi-04", None, (8, "non_finite")), "5 in all"
    assert len(lot.take(2)) == 5 and len(lot) == 0
    assert lot.admit(2, 3, "pi-01", _batch("pi-01", 3, mib=4)), "taken: its bytes are free"
    lot.clear()
    assert len(lot) == 0
