"""A reply that is no error but cannot be used (a device may send anything) fails that device
by name; it never raises inside the coordinator."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict

from coordinator.runner import _malformed, _malformed_evaluation
from wire.flower import array_record

pytestmark = pytest.mark.unit


def _reply(metrics: dict[str, object] | None, records: int = 1) -> object:
    content = RecordDict(
        {f"arrays{i}": array_record({"w": np.zeros(2, np.float32)}) for i in range(records)}
    )
    if metrics is not None:
        content["metrics"] = MetricRecord(metrics)  # type: ignore[arg-type]
    return SimpleNamespace(content=content)


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (_reply(None), "no metrics record"),
        (_reply({"loss": 1.0}), "num-examples None"),
        (_reply({"num-examples": -5}), "num-examples -5"),
        (_reply({"num-examples": float("nan")}), "num-examples nan"),
        (_reply({"num-examples": 4}, records=2), "2 weight records"),
        (_reply({"num-examples": 4}, records=0), "0 weight records"),
    ],
)
def test_an_unusable_train_reply_names_what_is_wrong(reply: object, why: str) -> None:
    problem = _malformed(reply)  # type: ignore[arg-type]
    assert problem is not None and why in problem


def test_a_good_reply_passes_and_evaluation_replies_are_checked_too() -> None:
    assert _malformed(_reply({"num-examples": 4, "loss": 0.5})) is None  # type: ignore[arg-type]
    good = _reply({"num-examples": 4, "accuracy": 0.5, "loss": 1.0})
    assert _malformed_evaluation(good) is None  # type: ignore[arg-type]
    lying = _reply({"num-examples": 4, "accuracy": 7.0, "loss": 1.0})
    assert "out of range" in str(_malformed_evaluation(lying))  # type: ignore[arg-type]
    assert "no metrics" in str(_malformed_evaluation(_reply(None)))  # type: ignore[arg-type]
