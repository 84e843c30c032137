"""The bounds on what an edge may claim: its examples (server-count, peer-median) and the norm
of its update (norm bound), as pure rules and inside the split-aware strategy."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Message, MetricRecord, RecordDict

from coordinator.aggregation import build_strategy
from coordinator.bounds import (
    bound_replica,
    cap_examples,
    clip_update,
    foreign_tensors,
    norm_limit,
    plausible_limit,
    server_counts,
    update_norm,
)
from split_models.errors import ConfigError
from wire.flower import TransportGrid, array_record
from wire.transport import InProcessHub

pytestmark = pytest.mark.unit

START = {"block0.w": np.zeros(4, np.float32), "block0.n": np.array(3, np.int64)}


def test_server_counts_are_summed_per_sender_and_bad_ones_are_named() -> None:
    assert server_counts([{"pi-01": 64, "pi-02": 32}, {"pi-01": 16}]) == {
        "pi-01": 80,
        "pi-02": 32,
    }
    assert server_counts([]) == {}
    for bad, why in [
        (None, "NoneType counts"),
        ({"pi-01": -1}, "-1 examples"),
        ({"pi-01": 2.5}, "2.5 examples"),
        ({"pi-01": True}, "True examples"),
        ({"pi-01": "9"}, "'9' examples"),
    ]:
        problem = server_counts([{"pi-02": 1}, bad])
        assert isinstance(problem, str) and why in problem, problem


def test_server_count_caps_a_claim_at_what_the_servers_trained() -> None:
    claims = {"honest": 320.0, "liar": 1e9, "unseen": 50.0}
    caps = cap_examples(claims, {"honest": 320, "liar": 288}, factor=10)
    assert [(c.device, c.claimed, c.allowed, c.rule) for c in caps] == [
        ("liar", 1e9, 288.0, "server-count"),
        ("unseen", 50.0, 0.0, "server-count"),  # nothing of it reached a server
    ]
    assert "liar claimed 1000000000 examples; weighted by 288 (server-count" in str(caps[0])


def test_peer_median_caps_a_claim_far_above_the_other_edges() -> None:
    claims = {"a": 100.0, "b": 120.0, "c": 110.0, "liar": 1e9}
    caps = cap_examples(claims, None, factor=10)
    assert [(c.device, c.allowed, c.rule) for c in caps] == [("liar", 1100.0, "peer-median")]
    share = 1100 / (1100 + 330)
    assert share < 0.8, "the liar no longer dominates the mean"
    assert cap_examples({"alone": 1e9}, None, factor=10) == [], "one edge has no peers"
    assert cap_examples(claims, None, factor=0) == [], "0 turns it off"


def test_the_norm_bound_judges_only_groups_of_three_with_a_scale() -> None:
    assert norm_limit([1.0, 2.0, 3.0], factor=10) == 20.0
    assert norm_limit([1.0, 500.0], factor=10) is None, "two replicas cannot judge"
    assert norm_limit([0.0, 0.0, 9.0], factor=10) is None, "a zero median gives no scale"
    assert norm_limit([1.0, 2.0, 3.0], factor=0) is None, "0 turns it off"


def test_a_clipped_update_keeps_its_direction_and_lands_on_the_bound() -> None:
    replica = {"block0.w": np.array([3.0, 4.0, 0.0, 0.0], np.float32), "block0.n": np.array(9)}
    assert update_norm(replica, START) == pytest.approx(5.0)
    clipped = clip_update(replica, START, 0.2)
    np.testing.assert_allclose(clipped["block0.w"], [0.6, 0.8, 0.0, 0.0], rtol=1e-6)
    assert clipped["block0.w"].dtype == np.float32
    assert clipped["block0.n"] == 9, "integer tensors are no update to scale"
    with pytest.raises(ValueError, match="scale in"):
        clip_update(replica, START, 1.5)


def _reply(node: int, arrays: dict[str, np.ndarray], examples: int = 10) -> Message:
    template = Message(RecordDict(), dst_node_id=node, message_type="train")
    metrics = MetricRecord({"num-examples": examples})
    return Message(
        RecordDict({"arrays": array_record(arrays), "metrics": metrics}), reply_to=template
    )


def _aggregate(
    norm_bound: float,
    trusted: frozenset[int] = frozenset(),
    steps: dict[int, float] | None = None,
) -> tuple[dict, object]:
    """Replicas of one tensor (norm 10 at the round's start) moving by 1, 2, 3 and (node 4)
    60 (``steps``: by node, others)."""
    TransportGrid(InProcessHub().connect("coordinator"))  # Flower's identity, as a run sets it
    strategy = build_strategy("fedavg", norm_bound=norm_bound)
    strategy._current = {"block0.w": np.full(4, 5.0, np.float32)}  # type: ignore[attr-defined]
    strategy.node_names = {n: f"pi-0{n}" for n in range(1, 5)}  # type: ignore[attr-defined]
    strategy.trusted_nodes = trusted  # type: ignore[attr-defined]
    steps = steps or {1: 1.0, 2: 2.0, 3: 3.0, 4: 60.0}
    replies = [
        _reply(n, {"block0.w": np.full(4, 5.0 + s / 2, np.float32)}) for n, s in steps.items()
    ]
    arrays, _ = strategy.aggregate_train(1, replies)
    assert arrays is not None
    return {k: v.numpy() for k, v in arrays.items()}, strategy


def test_the_strategy_clips_an_outlying_update_and_names_its_device() -> None:
    bounded, strategy = _aggregate(norm_bound=10)
    clips = strategy.clips  # type: ignore[attr-defined]
    assert [device for device, _ in clips] == ["pi-04"], clips
    assert "norm 60, above 10 x the median 2.5" in clips[0][1], clips
    # node 4's update is clipped to norm 25 (each coordinate 12.5): the mean of 0.5, 1, 1.5, 12.5
    np.testing.assert_allclose(bounded["block0.w"], np.full(4, 5 + 15.5 / 4), rtol=1e-5)
    unbounded, off = _aggregate(norm_bound=0)
    assert off.clips == []  # type: ignore[attr-defined]
    np.testing.assert_allclose(unbounded["block0.w"], np.full(4, 5 + 33.0 / 4), rtol=1e-5)
    _, trusting = _aggregate(norm_bound=10, trusted=frozenset({4}))
    assert trusting.clips == [], "a GPU server's update is never clipped"  # type: ignore[attr-defined]


@pytest.mark.parametrize("value", [0.5, -1, "ten", True, float("inf"), float("nan")])
@pytest.mark.parametrize("option", ["norm_bound", "examples_bound"])
def test_a_bad_bound_is_refused_by_name(option: str, value: object) -> None:
    with pytest.raises(ConfigError, match=f"{option}: expected 0 \\(off\\) or a number >= 1"):
        build_strategy("fedavg", **{option: value})
    assert build_strategy("krum", **{option: 0}).__dict__[option] == 0.0
    assert build_strategy("fedadam", **{option: 3}).__dict__[option] == 3.0


def test_a_reply_may_hold_only_the_tensors_it_was_given_in_their_shapes() -> None:
    given = {"a": np.zeros((2, 3)), "b": np.zeros(4)}
    assert foreign_tensors(given, {"a": np.ones((2, 3))}) is None  # fewer is no harm
    assert foreign_tensors(given, given) is None
    extra = foreign_tensors(given, {**given, "z.w": np.zeros(1), "c": np.zeros(1)})
    assert extra == "sent tensors it was not given (c, z.w)"
    grown = foreign_tensors(given, {"a": np.zeros((3, 3))})
    assert grown == "sent a of shape [3, 3], it was given [2, 3]"


@pytest.mark.parametrize("holders", [1, 2])
def test_an_implausible_update_is_left_out_where_too_few_replicas_judge(holders: int) -> None:
    """A device alone with its blocks (or with one other) wrote 1e20 into them unjudged: the
    round failed on every try. An update over 10 x its weights' norm is no training step."""
    honest = {n: float(n) for n in range(1, holders)}
    bounded, strategy = _aggregate(norm_bound=10, steps={**honest, 4: 2e20})
    clips = strategy.clips  # type: ignore[attr-defined]
    assert [device for device, _ in clips] == ["pi-04"], clips
    assert "over 10 x 10 (the norm of the weights it was given" in clips[0][1], clips
    assert "left out (its replica kept at the round's start)" in clips[0][1]
    # its replica counts as the start (5.0): alone, the tensor stays; else it halves the step
    want = 5.0 if holders == 1 else 5.0 + 0.5 / 2
    np.testing.assert_allclose(bounded["block0.w"], np.full(4, want), rtol=1e-6)
    _, fine = _aggregate(norm_bound=10, steps={**honest, 4: 19.0})
    assert fine.clips == []  # type: ignore[attr-defined]
    _, off = _aggregate(norm_bound=0, steps={**honest, 4: 2e20})
    assert off.clips == [], "norm_bound: 0 turns the update bounds off"  # type: ignore[attr-defined]


def test_batch_norm_statistics_are_no_part_of_an_updates_plausibility() -> None:
    """A running variance that grows 1000-fold in a round (unscaled inputs) is measured, not
    a step: the replica is kept."""
    start = {"b.weight": np.ones(4, np.float32), "b.running_var": np.ones(4, np.float32)}
    grown = {"b.weight": np.full(4, 1.5, np.float32), "b.running_var": np.full(4, 1000.0)}
    limit = plausible_limit(["b.weight", "b.running_var"], start)
    assert limit == pytest.approx(20.0)  # 10 x the weight's norm 2, the statistics left out
    clipped, why = bound_replica(grown, start, 2000.0, (1, None, limit), "pi-01's update", 10)
    assert clipped is None and why == ""
    lying = {**grown, "b.weight": np.full(4, 1e6, np.float32)}
    clipped, why = bound_replica(lying, start, 2e6, (1, None, limit), "pi-01's update", 10)
    assert clipped is not None and "left out" in why
    np.testing.assert_array_equal(clipped["b.weight"], start["b.weight"])
