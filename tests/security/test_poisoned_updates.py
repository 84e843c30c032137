"""A compromised edge lies in its train reply and does not dominate the round: real simulated
rounds (the deployment's agents in-process) where one edge claims 10^9 examples or sends its
update scaled 1000 times, against a clean run with the same seed."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flwr.app import Message

from coordinator.errors import CoordinatorError
from edge_client.agent import EdgeAgent
from simulation.config import parse_sim_config
from simulation.simulator import simulate
from storage import open_store
from wire.flower import array_record, numpy_arrays

pytestmark = pytest.mark.integration
pytest.importorskip("sklearn")

LIAR = "client-001"
# Four clients of one profile: one cut, so the edges' tensors form one group of four replicas.
FLEET = {
    "rounds": 2,
    "clients": 4,
    "devices": [{"profile": "pi", "share": 1.0, "memory": "8MiB", "flops": 2e9}],
    "measure_memory": False,
    "workers": 1,  # reproducible: a clean run and a capped lie give the same weights
}


def _lie(claim: int | None = None, scale: float = 1.0) -> Callable[..., Message]:
    """EdgeAgent._train where LIAR claims ``claim`` examples and scales its update."""
    honest = EdgeAgent._train

    def train(agent: EdgeAgent, message: Message, *args: Any) -> Message:
        reply = honest(agent, message, *args)
        if agent.device != LIAR or reply.has_error():
            return reply
        if claim is not None:
            reply.content.metric_records["metrics"]["num-examples"] = claim
        start, trained = numpy_arrays(message), numpy_arrays(reply, key=None)
        reply.content["arrays"] = array_record(
            {
                k: (start[k] + scale * (v - start[k])).astype(v.dtype) if v.dtype.kind == "f" else v
                for k, v in trained.items()
            }
        )
        return reply

    return train


def _simulate(tmp_path: Path, tag: str, **fields: Any) -> dict[str, Any]:
    config = parse_sim_config({**FLEET, **fields})
    summary = simulate(config, tmp_path / tag, run_id=tag)
    with open_store(f"sqlite:///{tmp_path / tag / 'runs.db'}") as store:
        state = store.resume(tag)
        assert state is not None
        results = {
            (r.number, d.device): d.examples for r in store.list_rounds(tag) for d in r.results
        }
        events = [(e.kind, e.device, e.detail) for e in store.events(tag)]
    return summary | {"weights": state.weights["global"], "events": events, "results": results}


def _distance(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> float:
    """``||a - b|| / ||b||`` over every tensor."""
    delta = sum(float(np.sum((a[k].astype(np.float64) - b[k]) ** 2)) for k in b)
    return float(np.sqrt(delta / sum(float(np.sum(b[k].astype(np.float64) ** 2)) for k in b)))


def test_a_claim_of_a_billion_examples_is_capped_at_what_the_gpu_server_trained(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = _simulate(tmp_path, "clean")
    monkeypatch.setattr(EdgeAgent, "_train", _lie(claim=10**9))
    lied = _simulate(tmp_path, "lied")
    capped = [e for e in lied["events"] if e[0] == "examples-capped"]
    assert [device for _, device, _ in capped] == [LIAR, LIAR], lied["events"]  # each round
    honest = clean["results"][(1, LIAR)]
    assert f"claimed 1000000000 examples; weighted by {honest} (server-count" in capped[0][2]
    assert lied["results"][(1, LIAR)] == honest, "the round records what was allowed"
    quiet = ("examples-capped", "update-clipped", "examples-repeated")  # nothing to say
    assert not [e for e in clean["events"] if e[0] in quiet], clean["events"]
    # weighted by what it really trained, the liar's weights are averaged as a clean run's
    assert _distance(lied["weights"], clean["weights"]) < 1e-6


def test_a_hugely_scaled_update_is_left_out_and_the_run_still_trains(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clean = _simulate(tmp_path, "clean")
    monkeypatch.setattr(EdgeAgent, "_train", _lie(scale=1000.0))
    boosted = _simulate(tmp_path, "boosted")
    clipped = [e for e in boosted["events"] if e[0] == "update-clipped"]
    assert [device for _, device, _ in clipped] == [LIAR, LIAR], boosted["events"]
    # 1000 x its step is also 48 x the weights it was given: left out, not only clipped
    assert "left out (its replica kept at the round's start)" in clipped[0][2], clipped
    assert not [e for e in boosted["events"] if e[0] == "round-failed"], boosted["events"]
    assert boosted["final_accuracy"] > clean["final_accuracy"] - 0.05, (boosted, clean)
    assert _distance(boosted["weights"], clean["weights"]) < 0.3
    # without the bound the same update blows the round up. The guard refuses its first
    # try; the retries train in other orders, and one that leaves the model at chance
    # without a loss jump may commit: either way the run is ruined, which the bound prevents
    try:
        ruined = _simulate(tmp_path, "unbounded", strategy={"name": "fedavg", "norm_bound": 0})
    except CoordinatorError as error:
        assert "round 1 failed 3 times" in str(error)
        ruined = {"final_accuracy": 0.0}
    with open_store(f"sqlite:///{tmp_path / 'unbounded' / 'runs.db'}") as store:
        refused = [e.detail for e in store.events("unbounded") if e.kind == "round-failed"]
        assert not [e for e in store.events("unbounded") if e.kind == "update-clipped"]
    assert refused and "the evaluation loss jumped" in refused[0], refused
    assert ruined["final_accuracy"] < clean["final_accuracy"] - 0.3, (ruined, clean)


def test_a_scaled_update_within_reach_of_the_weights_is_clipped_onto_the_norm_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """30 x its step: over 10 x the median of the replicas, under 10 x the weights' norm."""
    monkeypatch.setattr(EdgeAgent, "_train", _lie(scale=30.0))
    boosted = _simulate(tmp_path, "boosted")
    clipped = [e for e in boosted["events"] if e[0] == "update-clipped"]
    assert [device for _, device, _ in clipped] == [LIAR, LIAR], boosted["events"]
    assert "above 10 x the median" in clipped[0][2] and "of the 4 replicas" in clipped[0][2]


def _overreach(change: Callable[[dict[str, np.ndarray]], None]) -> Callable[..., Message]:
    """EdgeAgent._train where LIAR's reply is its honest one passed through ``change``."""
    honest = EdgeAgent._train

    def train(agent: EdgeAgent, message: Message, *args: Any) -> Message:
        reply = honest(agent, message, *args)
        if agent.device == LIAR and not reply.has_error():
            arrays = numpy_arrays(reply, key=None)
            change(arrays)
            reply.content["arrays"] = array_record(arrays)
        return reply

    return train


def _write_the_back(arrays: dict[str, np.ndarray]) -> None:
    # the cnn's last block is the GPU server's alone: its classifier's bias, pinned to class 0
    arrays["block5.0.bias"] = np.array([50.0] + [0.0] * 9, np.float32)


def _grow_a_tensor(arrays: dict[str, np.ndarray]) -> None:
    name = sorted(k for k, v in arrays.items() if v.ndim == 4)[0]
    arrays[name] = np.zeros((arrays[name].shape[0] + 1, *arrays[name].shape[1:]), np.float32)


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (_write_the_back, "sent tensors it was not given (block5.0.bias)"),
        (_grow_a_tensor, "of shape"),
    ],
)
def test_a_reply_with_tensors_the_edge_was_not_given_is_left_out_named(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    change: Callable[[dict[str, np.ndarray]], None],
    why: str,
) -> None:
    # found by a user-style trial: a liar's extra tensors were averaged into the back (its
    # bias pinned to a class), and a tensor of another shape crashed the coordinator's
    # aggregation on every restart
    monkeypatch.setattr(EdgeAgent, "_train", _overreach(change))
    lied = _simulate(tmp_path, "overreach")
    failures = {k: v for k, v in lied["results"].items() if k[1] == LIAR}
    with open_store(f"sqlite:///{tmp_path / 'overreach' / 'runs.db'}") as store:
        reasons = [
            d.failure for r in store.list_rounds("overreach") for d in r.results if d.failure
        ]
    assert len(reasons) == 2 and all(why in str(r) for r in reasons), reasons
    assert failures == {(1, LIAR): 0, (2, LIAR): 0}, failures
    assert abs(float(lied["weights"]["block5.0.bias"][0])) < 1.0
    assert lied["final_accuracy"] > 0.5, lied
