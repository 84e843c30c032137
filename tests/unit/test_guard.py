"""Which aggregates a round may not commit (pure logic, no store)."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.guard import divergence, non_finite_tensors
from storage.records import DeviceResult, RoundRecord

pytestmark = pytest.mark.unit

FINE = {"block0.w": np.ones(3, np.float32), "steps": np.array([5], np.int64)}


def _previous(loss: float | None, device_losses: dict[str, float]) -> RoundRecord:
    return RoundRecord(
        "r",
        1,
        "committed",
        ("pi-01", "gpu-a"),
        tuple(DeviceResult(d, examples=10, loss=v) for d, v in device_losses.items()),
        {},
        {} if loss is None else {"loss": loss},
    )


def test_non_finite_tensors_are_named() -> None:
    arrays = {**FINE, "block1.w": np.array([1.0, np.inf]), "block2.w": np.array([np.nan])}
    assert non_finite_tensors(arrays) == ["block1.w", "block2.w"]
    assert non_finite_tensors(FINE) == []


def test_divergence_by_weights_evaluation_loss_or_a_device_loss_jump() -> None:
    results = [DeviceResult("pi-01", examples=10, loss=1.1), DeviceResult("gpu-a", loss=4.7)]
    assert "block0.w" in str(divergence({"block0.w": np.array([np.nan])}, {}, results, None))
    assert "evaluation loss is nan" in str(divergence(FINE, {"loss": float("nan")}, [], None))
    assert divergence(FINE, {"loss": 9.0}, results, None) is None, "no round to compare with"
    by_eval = divergence(FINE, {"loss": 4.0}, results, _previous(1.0, {}))
    assert by_eval == "the evaluation loss jumped from 1.000 to 4.000"
    assert divergence(FINE, {"loss": 2.5}, results, _previous(1.0, {})) is None
    assert divergence(FINE, {"loss": 0.09}, results, _previous(0.02, {})) is None, "margin"
    by_device = divergence(FINE, {}, results, _previous(None, {"pi-01": 1.4, "gpu-a": 1.0}))
    assert by_device == "gpu-a's training loss jumped from 1.000 to 4.700"
    assert divergence(FINE, {}, results, _previous(None, {"pi-01": 1.4, "gpu-a": 2.0})) is None


def test_an_edge_alone_reporting_a_leap_does_not_refuse_the_round() -> None:
    edges = ["pi-01", "pi-02", "pi-03"]
    before = _previous(None, {"pi-01": 0.1, "pi-02": 0.5, "pi-03": 0.6, "gpu-a": 1.0})
    honest = [DeviceResult(e, examples=10, loss=0.4) for e in edges[1:]]
    liar = DeviceResult("pi-01", examples=10, loss=1e6)  # a device may say anything
    assert divergence(FINE, {}, [liar, *honest], before, edges) is None
    two = [liar, DeviceResult("pi-02", examples=10, loss=9.0), honest[1]]
    refused = divergence(FINE, {}, two, before, edges)
    assert refused is not None and refused.startswith("2 of 3 edges' training losses jumped")
    assert "pi-02's from 0.500 to 9.000" in refused
    server = DeviceResult("gpu-a", loss=5.0)  # the back's loss: one leap is enough
    by_server = divergence(FINE, {}, [*honest, server], before, edges)
    assert by_server == "gpu-a's training loss jumped from 1.000 to 5.000"
