"""The strategy's server-side optimizer state as checkpoint tensors: saved by name, taken up
for the resumed weights, and what does not fit them (a corrupt or foreign checkpoint) left
out and named, never loaded."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.aggregation import build_strategy
from coordinator.server_state import restore_server_tensors, server_tensors
from wire.flower import array_record

WEIGHTS = {"a": np.ones((2, 3), np.float32), "b": np.zeros(4, np.float32)}


def test_fedopt_moments_round_trip_by_name() -> None:
    strategy = build_strategy("fedadam")
    strategy.m_t = {"a": np.full((2, 3), 0.5, np.float32), "b": np.arange(4, dtype=np.float32)}
    strategy.v_t = {k: v * v for k, v in strategy.m_t.items()}

    saved = server_tensors(strategy)
    fresh = build_strategy("fedadam")
    dropped = restore_server_tensors(fresh, saved, WEIGHTS)

    assert sorted(saved) == ["m_t/a", "m_t/b", "v_t/a", "v_t/b"] and dropped == []
    for name in ("m_t", "v_t"):
        ours, theirs = getattr(strategy, name), getattr(fresh, name)
        assert all(np.array_equal(ours[k], theirs[k]) for k in WEIGHTS)


def test_fedavgm_momentum_is_saved_by_the_names_of_its_weights() -> None:
    strategy = build_strategy("fedavgm", server_momentum=0.9)
    strategy.current_arrays = array_record({"b": WEIGHTS["b"], "a": WEIGHTS["a"]})
    strategy.momentum_vector = [np.full(4, 2.0, np.float32), np.full((2, 3), 3.0, np.float32)]

    fresh = build_strategy("fedavgm", server_momentum=0.9)
    assert restore_server_tensors(fresh, server_tensors(strategy), WEIGHTS) == []

    assert list(fresh.current_arrays.keys()) == ["a", "b"]  # the resumed weights' order
    assert [float(m.flat[0]) for m in fresh.momentum_vector] == [3.0, 2.0]


@pytest.mark.parametrize(
    ("name", "value", "why"),
    [
        ("m_t/a", np.ones((3, 2), np.float32), "shape [3, 2]"),
        ("m_t/a", np.full((2, 3), np.nan, np.float32), "non-finite"),
        ("v_t/a", np.full((2, 3), -1.0, np.float32), "below zero"),
        ("m_t/ghost", np.ones(1, np.float32), "no such tensor"),
        ("momentum/a", np.ones((2, 3), np.float32), "keeps no 'momentum' state"),
        ("m_t/a", np.array([["x"] * 3] * 2), "not numeric"),
    ],
)
def test_a_tensor_that_does_not_fit_is_left_out_and_named(
    name: str, value: np.ndarray, why: str
) -> None:
    strategy = build_strategy("fedadam")
    good = {"m_t/b": np.ones(4, np.float32), "v_t/b": np.ones(4, np.float32)}

    dropped = restore_server_tensors(strategy, good | {name: value}, WEIGHTS)

    assert len(dropped) == 1 and dropped[0].startswith(name) and why in dropped[0], dropped
    assert np.array_equal(strategy.m_t["b"], np.ones(4, np.float32)), "the rest is taken up"
    assert np.array_equal(strategy.m_t["a"], np.zeros((2, 3), np.float32)), "the rest at zero"


def test_a_rule_without_server_state_saves_nothing() -> None:
    assert server_tensors(build_strategy("fedavg")) == {}
    assert server_tensors(build_strategy("fedadam")) == {}, "nothing before its first round"
