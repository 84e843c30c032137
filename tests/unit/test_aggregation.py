"""Aggregation across heterogeneous splits against NumPy oracles, through real Flower rounds."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAdam
from flwr.supercore.task_identity import TaskIdentity

from coordinator.aggregation import (
    STRATEGIES,
    build_strategy,
    flower_quiet,
    key_groups,
    split_weighted_mean,
)
from split_models.errors import ConfigError
from wire.flower import FlowerNode, TransportGrid, array_record, node_will, numpy_arrays
from wire.transport import InProcessHub

pytestmark = pytest.mark.unit

RNG = np.random.default_rng(0)
MODEL = {
    "block0.w": RNG.standard_normal((3, 2)).astype(np.float32),
    "block1.w": RNG.standard_normal(4).astype(np.float32),
    "block2.w": RNG.standard_normal(2).astype(np.float32),  # held by the GPU server only
    "head1.w": RNG.standard_normal(5).astype(np.float32),
    "head2.w": RNG.standard_normal(5).astype(np.float32),
    "block3.w": RNG.standard_normal(5).astype(np.float32),  # the classifier head1 can mirror
}
# Node 1 splits after block 0, nodes 2 and 3 after block 1: different keys, different heads.
HOLDINGS = {
    1: ["block0.w", "head1.w"],
    2: ["block0.w", "block1.w", "head2.w"],
    3: ["block0.w", "block1.w", "head2.w"],
}
EXAMPLES = {1: 10, 2: 30, 3: 60}


def trained(node: int, key: str, current: np.ndarray) -> np.ndarray:
    # steps of a tenth: an update many times the weights is refused as no training step
    step = 0.1 * node * (1 + np.arange(current.size, dtype=np.float32))
    return current + step.reshape(current.shape).astype(np.float32)


def oracle(reduce: str) -> dict[str, np.ndarray]:
    result = {}
    for key, value in MODEL.items():
        holders = [n for n, keys in HOLDINGS.items() if key in keys]
        if not holders:
            result[key] = value
            continue
        stack = np.stack([trained(n, key, value) for n in holders])
        weights = np.array([EXAMPLES[n] for n in holders], dtype=np.float64)
        if reduce == "mean":
            result[key] = (np.tensordot(weights, stack, axes=1) / weights.sum()).astype(np.float32)
        else:
            result[key] = np.median(stack, axis=0).astype(np.float32)
    return result


app = ClientApp()


@app.train()
def train(message: Message, context: Context) -> Message:
    current = numpy_arrays(message)  # not Array.numpy(): see wire.flower.array_numpy
    node = context.node_id
    mine = {k: trained(node, k, current[k]) for k in HOLDINGS[node]}
    metrics = MetricRecord({"num-examples": EXAMPLES[node]})
    if node == 1:  # devices report different metrics (a GPU server has no peak, say)
        metrics["peak-memory"] = 1 << 20
    return Message(RecordDict({"arrays": array_record(mine), "metrics": metrics}), reply_to=message)


def federate(name: str, **options: object) -> dict[str, np.ndarray]:
    return federate_with(name, **options)[0]


def federate_with(
    name: str, mirrors: dict[str, str] | None = None, **options: object
) -> tuple[dict[str, np.ndarray], object]:
    logging.getLogger("flwr").setLevel(logging.WARNING)
    hub = InProcessHub()
    grid = TransportGrid(hub.connect("coordinator"))
    nodes = [FlowerNode(hub.connect(f"n{n}", node_will(n)), n, app) for n in HOLDINGS]
    assert grid.wait_for_nodes(3, timeout=10) == [1, 2, 3]
    strategy = build_strategy(
        name, fraction_evaluate=0.0, min_available_nodes=3, min_train_nodes=3, **options
    )
    strategy.mirrors = mirrors or {}  # type: ignore[attr-defined]  # as the runner sets them
    result = strategy.start(grid=grid, initial_arrays=array_record(MODEL), num_rounds=1, timeout=30)
    for node in nodes:
        node.transport.close()
    return {k: v.numpy() for k, v in result.arrays.items()}, strategy


def test_weighted_mean_over_exactly_the_holders() -> None:
    got = federate("fedavg")
    expected = oracle("mean")
    for key in MODEL:
        np.testing.assert_allclose(got[key], expected[key], rtol=1e-6)
    assert np.array_equal(got["block2.w"], MODEL["block2.w"]), "untrained tensors keep values"
    assert np.array_equal(got["head1.w"], trained(1, "head1.w", MODEL["head1.w"])), (
        "a head is averaged only among the devices sharing its cut"
    )


def test_a_robust_rule_leaves_mirrored_heads_out_of_the_back() -> None:
    # krum would pick one edge's head over the GPU servers' classifier (their one replica)
    plain, got = federate("fedmedian"), federate("fedmedian", mirrors={"head1.w": "block3.w"})
    assert all(np.array_equal(plain[k], got[k]) for k in MODEL)


@pytest.mark.parametrize("name", ["fedavg", "fedadam"])
def test_a_head_that_mirrors_the_back_is_aggregated_as_its_replica(name: str) -> None:
    # head_from_back: node 1's head starts each round as block 3 (the classifier); what it
    # trained counts as a replica of block 3, and the stored head follows the result
    plain = federate(name)
    got = federate(name, mirrors={"head1.w": "block3.w"})
    assert np.array_equal(plain["block3.w"], MODEL["block3.w"]), "no replica without mirrors"
    assert not np.allclose(got["block3.w"], MODEL["block3.w"])
    assert np.array_equal(got["head1.w"], got["block3.w"])
    if name == "fedavg":  # node 1 alone holds it: its head is the result
        np.testing.assert_allclose(got["block3.w"], trained(1, "head1.w", MODEL["head1.w"]))
    for key in ("block0.w", "block1.w", "head2.w"):  # the rest as before
        np.testing.assert_allclose(got[key], plain[key], rtol=1e-6)


def test_robust_rule_per_group_of_holders() -> None:
    got = federate("fedmedian")
    for key, value in oracle("median").items():
        np.testing.assert_allclose(got[key], value, rtol=1e-6)


@pytest.mark.parametrize("name", STRATEGIES)
def test_every_strategy_aggregates_mixed_cuts(name: str) -> None:
    got = federate(name)
    assert set(got) == set(MODEL)
    assert all(np.isfinite(v).all() for v in got.values())
    assert not np.allclose(got["block0.w"], MODEL["block0.w"]), "trained tensors move"
    assert np.array_equal(got["block2.w"], MODEL["block2.w"]), "untrained tensors keep values"


def test_a_group_too_small_for_the_rule_falls_back_to_the_median_and_says_so() -> None:
    got, strategy = federate_with("krum", num_malicious_nodes=1)  # needs 5 replicas a group
    notes = list(strategy.notes)  # type: ignore[attr-defined]
    assert len(notes) == 3, notes  # block0 (3 holders), block1 + head2 (2), head1 (1)
    assert any("block0.*" in n and "fewer than the 5" in n for n in notes), notes
    # a group of one (a single GPU server's back, here head1) is taken as it is: a "median"
    # of one replica said the rule had fallen back to something it had not
    (alone,) = [n for n in notes if "head1" in n]
    assert "alone holds" in alone and "taken as it is" in alone and "median" not in alone
    for key, value in oracle("median").items():
        np.testing.assert_allclose(got[key], value, rtol=1e-6)
    _, plain = federate_with("krum")  # f = 0 needs 3: only the smaller groups fall back
    assert len(plain.notes) == 2 and not any("block0" in n for n in plain.notes)  # type: ignore[attr-defined]


def test_server_optimizer_runs_on_the_split_aware_mean() -> None:
    got = federate("fedadam", eta=0.1)
    reference = FedAdam(eta=0.1)
    reference.current_arrays = {k: v.copy() for k, v in MODEL.items()}
    mean = oracle("mean")
    template = Message(RecordDict(), dst_node_id=1, message_type="train")
    reply = Message(
        RecordDict({"arrays": array_record(mean), "metrics": MetricRecord({"num-examples": 1})}),
        reply_to=template,
    )
    expected, _ = reference.aggregate_train(1, [reply])
    assert expected is not None
    for key, value in expected.items():
        np.testing.assert_allclose(got[key], value.numpy(), rtol=1e-6)
    assert not np.allclose(got["block0.w"], MODEL["block0.w"])
    assert np.array_equal(got["block2.w"], MODEL["block2.w"])


def test_numpy_core_and_key_groups() -> None:
    current = {"a": np.zeros(2, np.float32), "b": np.ones(2, np.float32)}
    replicas = [
        {"a": np.array([1.0, 2.0], np.float32)},
        {"a": np.array([3.0, 6.0], np.float32), "b": np.array([5.0, 5.0], np.float32)},
    ]
    mean = split_weighted_mean(replicas, [1.0, 3.0], current)
    np.testing.assert_allclose(mean["a"], [2.5, 5.0])
    np.testing.assert_allclose(mean["b"], [5.0, 5.0])
    assert mean["a"].dtype == np.float32
    assert key_groups(replicas) == {(0, 1): ["a"], (1,): ["b"]}
    with pytest.raises(ValueError, match="does not have"):
        split_weighted_mean([{"c": np.zeros(2)}], [1.0], current)
    with pytest.raises(ValueError, match="shape"):
        split_weighted_mean([{"a": np.zeros(3)}], [1.0], current)


def test_unknown_strategy_and_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="unknown 'fedmagic'"):
        build_strategy("fedmagic")
    with pytest.raises(ConfigError, match="bad option"):
        build_strategy("fedavg", learning_rate_of_doom=3)


def test_flower_is_quiet_while_the_strategy_works_and_gets_its_level_back() -> None:
    flower = logging.getLogger("flwr")
    before = flower.level
    with flower_quiet():
        assert not flower.isEnabledFor(logging.INFO), "no 'Sampled N nodes' every round"
        assert flower.isEnabledFor(logging.WARNING)
    assert flower.level == before


def _replies(arrays: list[dict[str, np.ndarray]]) -> list[Message]:
    replies = []
    for node, tensors in enumerate(arrays, start=1):
        template = Message(RecordDict(), dst_node_id=node, message_type="train")
        content = RecordDict(
            {"arrays": array_record(tensors), "metrics": MetricRecord({"num-examples": 10})}
        )
        replies.append(Message(content, reply_to=template))
    return replies


@pytest.mark.parametrize(
    ("name", "options"),
    [("fedavgm", {"server_momentum": 0.9}), ("fedadam", {"eta": 0.1})],
    ids=["fedavgm", "fedadam"],
)
def test_server_steps_leave_running_statistics_averaged_and_dtypes_as_they_were(
    name: str, options: dict[str, object], monkeypatch: pytest.MonkeyPatch
) -> None:
    for field in ("_run_id", "_node_id", "_task_id"):  # a grid sets them; no grid here
        monkeypatch.setattr(TaskIdentity, field, 1)
    bn = "block0.1."
    weights = {
        bn + "weight": np.ones(3, np.float32),
        bn + "running_var": np.ones(3, np.float32),
        bn + "num_batches_tracked": np.array(4, np.int64),
    }
    strategy = build_strategy(name, **options)
    # two rounds in which the devices' running variance falls to 0.1 and stays: FedAvgM's
    # momentum carried the first fall on past zero in the second (NaN in the model)
    for _ in range(2):
        strategy._current = dict(weights)  # what configure_train sets
        if name == "fedadam":
            strategy.current_arrays = dict(weights)
        elif strategy.current_arrays is None:
            strategy.current_arrays = array_record(weights)
        trained = [
            {bn + "weight": weights[bn + "weight"] + step, bn + "running_var": np.full(3, var)}
            | {bn + "num_batches_tracked": np.array(9, np.int64)}
            for step, var in ((0.5, 0.05), (1.5, 0.15))
        ]
        for tensors in trained:
            tensors[bn + "running_var"] = tensors[bn + "running_var"].astype(np.float32)
        arrays, _ = strategy.aggregate_train(1, _replies(trained))
        assert arrays is not None
        weights = {k: v.numpy() for k, v in arrays.items()}

    np.testing.assert_allclose(weights[bn + "running_var"], 0.1, rtol=1e-6)
    assert int(weights[bn + "num_batches_tracked"]) == 9
    assert {k: v.dtype for k, v in weights.items()} == {
        bn + "weight": np.float32,
        bn + "running_var": np.float32,
        bn + "num_batches_tracked": np.int64,
    }


@pytest.mark.parametrize(
    ("name", "option", "value", "expected"),
    [
        ("fedavgm", "server_momentum", "x", r"expected a number in \[0, 1\)"),
        ("fedavgm", "server_momentum", 1.0, r"in \[0, 1\), got 1.0"),
        ("fedavgm", "server_learning_rate", float("nan"), r"in \(0, inf\), got nan"),
        ("fedadam", "eta", -1, r"expected a number in \(0, inf\), got -1"),
        ("fedadam", "eta", True, "got True"),  # not read as 1.0
        ("fedadam", "beta_1", 1.5, r"expected a number in \[0, 1\)"),
        ("fedyogi", "tau", 0, r"expected a number in \(0, inf\)"),
        ("fedprox", "proximal_mu", -0.1, r"expected a number in \[0, 1e\+06\]"),
        ("fedtrimmedavg", "beta", 0.5, r"expected a number in \[0, 0.5\)"),
        ("krum", "num_malicious_nodes", 1.5, "expected a whole number"),
        ("multikrum", "num_nodes_to_select", 0, r"in \[1, inf\)"),
        ("fedavg", "fraction_train", 0, r"expected a number in \(0, 1\]"),
        ("fedavg", "arrayrecord_key", "x", "set by edgesplit itself"),
        ("fedprox", "proximal-mu", 0.1, "write it proximal_mu"),
    ],
)
def test_an_option_out_of_its_range_is_a_config_error_naming_it(
    name: str, option: str, value: object, expected: str
) -> None:
    with pytest.raises(ConfigError, match=f"strategy '{name}': {option}: .*{expected}"):
        build_strategy(name, **{option: value})


def test_options_at_the_edges_of_their_ranges_build() -> None:
    build_strategy("fedavgm", server_momentum=0.0, server_learning_rate=1e-3)
    build_strategy("fedadam", eta=1e-4, beta_1=0.0, beta_2=0.999, tau=1e-9)
    build_strategy("fedprox", proximal_mu=0)
    build_strategy("multikrum", num_malicious_nodes=0, num_nodes_to_select=1)
    build_strategy("fedavg", fraction_train=1, fraction_evaluate=0.0)


@pytest.mark.parametrize("name", ["krum", "multikrum", "fedmedian", "fedtrimmedavg", "bulyan"])
def test_robust_rules_keep_every_tensor_in_the_models_dtype(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Flower's rules returned BatchNorm's int64 batch count as float64; the next round's
    replies, int64 again, were refused as another dtype and a krum run with a BatchNorm
    model failed its second round."""
    for field in ("_run_id", "_node_id", "_task_id"):  # a grid sets them; no grid here
        monkeypatch.setattr(TaskIdentity, field, 1)
    bn = "block0.1."
    weights = {bn + "weight": np.ones(3, np.float32), bn + "num_batches_tracked": np.array(4)}
    strategy = build_strategy(name)
    strategy._current = dict(weights)  # what configure_train sets
    trained = [  # seven replicas: enough for every rule, none falls back to the median
        {bn + "weight": np.full(3, 1 + i / 10, np.float32), bn + "num_batches_tracked": np.array(9)}
        for i in range(7)
    ]

    arrays, _ = strategy.aggregate_train(1, _replies(trained))

    assert arrays is not None and not strategy.notes
    got = {k: v.numpy() for k, v in arrays.items()}
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in weights.items()}
    assert int(got[bn + "num_batches_tracked"]) == 9
