"""``norm: recalibrate``: the statistics a device measures, the checks on its reply, the pooling
(a NumPy oracle) and the round's recalibration with fake devices."""

from __future__ import annotations

import logging
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from flwr.app import Message, MetricRecord, RecordDict
from torch import nn

from coordinator.statistics import (
    DEVICES,
    SAMPLES,
    Recalibration,
    outliers,
    pool_statistics,
    statistics_of,
)
from split_models.config import ModelConfig
from split_models.data import Dataset
from split_models.evaluation import STATISTIC_BLOCKS, STATISTICS, batch_statistics, statistic_keys
from split_models.segment import Segment
from split_models.weights import segment_state
from wire.flower import array_record

pytestmark = pytest.mark.unit

M, V = "block0.bn.running_mean", "block0.bn.running_var"
SPEC = ModelConfig("resnet8", (1, 12, 12), 10)


def _weights() -> dict[str, np.ndarray]:
    model = SPEC.build(seed=0)
    return segment_state(Segment.from_model(model, 0, model.num_blocks))


def _data(rows: int, shift: float = 0.0) -> Dataset:
    rng = np.random.default_rng(1)
    x = rng.normal(shift, 1.0, (rows, 1, 12, 12)).astype(np.float32)
    return Dataset(x, rng.integers(0, 10, rows), 10)


def _reply(arrays: dict[str, np.ndarray], count: object = 100) -> Message:
    metrics = MetricRecord({"num-examples": count})  # type: ignore[dict-item]
    content = RecordDict({"arrays": array_record(arrays), "metrics": metrics})
    return SimpleNamespace(content=content, has_error=lambda: False)  # type: ignore[return-value]


def _failed(reason: str) -> Message:
    error = SimpleNamespace(reason=reason)
    return SimpleNamespace(has_error=lambda: True, error=error)  # type: ignore[return-value]


def test_a_device_measures_what_update_bn_measures_and_nothing_else_changes() -> None:
    weights, data = _weights(), _data(200)
    stats, count = batch_statistics(SPEC, weights, data, 150, seed=3)
    assert count == 150 and list(stats) == statistic_keys(weights)
    model = SPEC.build(seed=0)
    whole = Segment.from_model(model, 0, model.num_blocks)
    rows = np.sort(np.random.default_rng(3).permutation(200)[:150])
    batches = [(torch.from_numpy(data.x[rows[b : b + 64]]),) for b in range(0, 150, 64)]
    torch.optim.swa_utils.update_bn(batches, whole.module)  # torch's own re-estimation
    oracle = segment_state(whole)
    for key, value in stats.items():
        np.testing.assert_allclose(value, oracle[key], rtol=1e-4, atol=1e-6)
        assert not np.allclose(value, weights[key])  # measured, not the initial 0 and 1


def test_pooled_statistics_are_the_union_s_moments() -> None:
    rng = np.random.default_rng(0)
    parts = [rng.normal(loc, scale, (n, 3)) for loc, scale, n in ((0, 1, 50), (4, 2, 150))]
    measured = [(len(p), {M: p.mean(0), V: p.var(0)}) for p in parts]
    pooled = pool_statistics(measured)
    union = np.concatenate(parts)
    np.testing.assert_allclose(pooled[M], union.mean(0), rtol=1e-5)
    np.testing.assert_allclose(pooled[V], union.var(0), rtol=1e-5)
    # the average of the two variances misses the spread between the devices' means
    assert (pooled[V] > 1.5 * (0.25 * parts[0].var(0) + 0.75 * parts[1].var(0))).all()


GOOD = {
    M: np.zeros(4, np.float32),
    V: np.ones(4, np.float32),
}


@pytest.mark.parametrize(
    ("arrays", "count", "why"),
    [
        (GOOD, 1, "sample count"),
        (GOOD, SAMPLES + 1, "sample count"),
        (GOOD, 2.5, "sample count"),
        ({M: GOOD[M]}, 10, "other layers"),
        (GOOD | {"block1.bn.running_mean": np.zeros(4, np.float32)}, 10, "other layers"),
        (GOOD | {V: np.ones(5, np.float32)}, 10, r"shape \[5\], not \[4\]"),
        (GOOD | {V: np.ones(4, np.int32)}, 10, "int32 values, not floating point"),
        (GOOD | {M: np.full(4, np.nan, np.float32)}, 10, "NaN or infinity"),
        (GOOD | {V: -np.ones(4, np.float32)}, 10, "negative variance"),
        (GOOD | {M: np.full(4, 1e30, np.float32)}, 10, "above 1e[+]08"),
        (GOOD | {V: np.full(4, 1e30, np.float32)}, 10, "above 1e[+]16"),
    ],
)
def test_a_lying_reply_is_named_and_left_out(
    arrays: dict[str, np.ndarray], count: object, why: str
) -> None:
    result = statistics_of(_reply(arrays, count), GOOD, SAMPLES)
    assert isinstance(result, str) and re.search(why, result), result


def test_a_well_formed_reply_counts() -> None:
    result = statistics_of(_reply(GOOD, 10), GOOD, SAMPLES)
    assert not isinstance(result, str)
    count, arrays = result
    assert count == 10 and set(arrays) == set(GOOD)
    np.testing.assert_array_equal(arrays[V], GOOD[V])


class _Fleet:
    """Fake devices: each answers with the statistics ``answers`` gives it (or an error)."""

    def __init__(self, answers: dict[str, Message]) -> None:
        self.answers, self.asked = answers, []  # type: list[str]

    def address(self, number: int, device: str, arrays: object, config: dict[str, int]) -> str:
        assert config == {STATISTICS: SAMPLES, STATISTIC_BLOCKS: 1}
        return device

    def collect(self, messages: dict[str, str], deadline: float) -> dict[str, Message]:
        self.asked = sorted(messages)
        return {d: self.answers[d] for d in messages if d in self.answers}


def test_the_aggregate_takes_the_pooled_statistics_of_the_edges_that_answered_well(
    caplog: pytest.LogCaptureFixture,
) -> None:
    merged = {"w": np.ones(2, np.float32)} | GOOD
    honest = {
        M: np.full(4, 2, np.float32),
        V: np.ones(4, np.float32),
    }
    fleet = _Fleet(
        {
            "a": _reply(honest, 30),
            "b": _reply(honest | {M: np.full(4, 4, np.float32)}, 10),
            "c": _reply(honest | {V: np.full(4, np.inf, np.float32)}, 10),
            "d": _failed("out of memory"),
        }
    )
    recalibration = Recalibration(fleet.address, fleet.collect, 1.0, 0, lambda _d, _b: 99)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING):
        result = recalibration(2, merged, ["d", "c", "b", "a"])
    assert fleet.asked == ["a", "b", "c", "d"]
    np.testing.assert_allclose(result[M], 2.5)  # (30 * 2 + 10 * 4) / 40
    np.testing.assert_allclose(result[V], 1 + (30 * 4 + 10 * 16) / 40 - 6.25)
    assert result["w"] is merged["w"]
    assert (
        "c's BatchNorm statistics left out: block0.bn.running_var holds NaN or infinity"
        in caplog.text
    )
    assert "d's BatchNorm statistics left out: failed: out of memory" in caplog.text


def test_without_batchnorm_or_answers_the_aggregate_stays(caplog: pytest.LogCaptureFixture) -> None:
    fleet = _Fleet({})
    recalibration = Recalibration(fleet.address, fleet.collect, 1.0, 0, lambda _d, _b: 99)  # type: ignore[arg-type]
    plain = {"w": np.ones(2, np.float32)}
    assert recalibration(1, plain, ["a"]) is plain and fleet.asked == []
    merged = plain | GOOD
    with caplog.at_level(logging.WARNING):
        assert recalibration(1, merged, ["a", "b"]) is merged
    assert "no edge measured the BatchNorm statistics (2 asked)" in caplog.text


def test_at_most_a_sample_of_the_edges_is_asked_the_same_for_a_round() -> None:
    edges = [f"e{i:02d}" for i in range(30)]
    fleet = _Fleet({})
    recalibration = Recalibration(fleet.address, fleet.collect, 1.0, 0, lambda _d, _b: 99)  # type: ignore[arg-type]
    merged = {"w": np.ones(2, np.float32)} | GOOD
    recalibration(4, merged, edges)
    first = fleet.asked
    recalibration(4, merged, list(reversed(edges)))
    assert len(first) == DEVICES and fleet.asked == first
    recalibration(5, merged, edges)
    assert fleet.asked != first


def test_dropout_stays_off_while_measuring() -> None:
    class Noisy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.drop, self.bn = nn.Dropout(0.9), nn.BatchNorm1d(4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.bn(self.drop(x))

    from split_models.zoo import SplittableModel

    model = SplittableModel("noisy", nn.ModuleList([Noisy()]), (4,), 4)

    class Spec:
        def build(self, seed: int = 0) -> SplittableModel:
            return model

    x = np.random.default_rng(0).normal(5, 1, (128, 4)).astype(np.float32)
    weights = segment_state(Segment.from_model(model, 0, 1))
    stats, _ = batch_statistics(Spec(), weights, Dataset(x, np.zeros(128, np.int64), 4), 128, 0)  # type: ignore[arg-type]
    np.testing.assert_allclose(stats[M], x.mean(0), rtol=1e-5)


def test_with_a_robust_strategy_one_liar_moves_the_statistics_little() -> None:
    honest = [
        (64, {M: np.full(4, m, np.float32), V: np.full(4, 1.0, np.float32)}) for m in (0, 0.1, -0.1)
    ]
    liar = (64, {M: np.full(4, 1e6, np.float32), V: np.full(4, 1e-12, np.float32)})
    by_count = pool_statistics([*honest, liar])
    robust = pool_statistics([*honest, liar], robust=True)
    assert (by_count[M] > 1e5).all()  # the mean follows the liar
    assert (np.abs(robust[M]) <= 0.1).all() and (np.abs(robust[V] - 1) < 0.1).all()
    # fewer than three devices: nothing to take a median of, so by count
    pair = pool_statistics(honest[:2], robust=True)
    np.testing.assert_allclose(pair[M], 0.05, rtol=1e-6)


def test_an_edge_far_from_the_others_is_left_out_by_name_and_a_silent_one_named(
    caplog: pytest.LogCaptureFixture,
) -> None:
    merged = {"w": np.ones(2, np.float32)} | GOOD
    rng = np.random.default_rng(0)

    def honest() -> Message:
        stats = {M: rng.normal(0, 0.3, 4).astype(np.float32), V: np.full(4, 1.0, np.float32)}
        return _reply(stats, 64)

    liar = {M: np.full(4, 50.0, np.float32), V: np.full(4, 1e-4, np.float32)}  # plausible
    fleet = _Fleet({"a": honest(), "b": honest(), "c": honest(), "liar": _reply(liar, 64)})
    recalibration = Recalibration(fleet.address, fleet.collect, 1.0, 0, lambda _d, _b: 1)  # type: ignore[arg-type]
    with caplog.at_level(logging.INFO):
        result = recalibration(3, merged, ["a", "b", "c", "liar", "silent"])
    assert (np.abs(result[M]) < 1).all() and (np.abs(result[V] - 1) < 0.2).all()
    assert "liar's BatchNorm statistics left out: block0.bn's means stray" in caplog.text
    assert "silent's BatchNorm statistics left out: no answer in time" in caplog.text
    assert "measured by a, b, c (192 samples)" in caplog.text
    # a variance far off alone is enough
    variances = {"a": 1.0, "b": 1.0, "c": 1.0, "d": 1e4}
    stray = outliers({d: (64, {M: np.zeros(4), V: np.full(4, v)}) for d, v in variances.items()})
    assert list(stray) == ["d"] and "variances stray" in stray["d"]
    # two edges cannot tell which one strays: both count
    assert (
        outliers({d: (64, {M: np.full(4, m), V: np.ones(4)}) for d, m in (("a", 0), ("b", 99))})
        == {}
    )


@pytest.mark.parametrize("plain_loss", [0.5, float("nan")])
def test_statistics_that_make_the_round_diverge_are_dropped_not_the_round(
    plain_loss: float,
) -> None:
    from coordinator.recorder import Outcome
    from coordinator.runner import _judged

    merged = {"w": np.ones(2, np.float32)} | GOOD
    settled = merged | {V: np.full(4, 1e-12, np.float32)}
    events: list[tuple[int, str, str]] = []
    recorder = SimpleNamespace(
        central_evaluation=lambda w: {"loss": float("nan") if w is settled else plain_loss},
        event=lambda number, kind, detail: events.append((number, kind, detail)),
    )
    runner = SimpleNamespace(recorder=recorder, settle=lambda _n, _m, _t: settled)
    outcome = Outcome([], [], {}, 0.0)
    weights, evaluation, why = _judged(runner, 4, merged, ["a"], (outcome, (None, None)))  # type: ignore[arg-type]
    if plain_loss == plain_loss:  # the averaged statistics pass: they are committed
        assert weights is merged and why is None and evaluation == {"loss": 0.5}
        assert [(n, k) for n, k, _ in events] == [(4, "statistics-dropped")]
    else:  # both fail: the round is refused as it would be without the statistics
        assert weights is settled and why == "the evaluation loss is nan" and events == []
