"""Every documented option trains: each strategy with mixed cuts in both split modes, FedProx
against FedAvg, reproducible seeded runs (simulations on the bundled digits, in-process)."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from coordinator.aggregation import STRATEGIES
from coordinator.errors import CoordinatorError, RunCancelled
from coordinator.recorder import RoundObserver
from simulation.config import parse_sim_config
from simulation.simulator import simulate
from split_models.segment import Segment
from split_models.weights import segment_state
from storage import open_store

pytestmark = pytest.mark.integration
pytest.importorskip("sklearn")

_OPTIONS: dict[str, dict[str, Any]] = {"fedprox": {"proximal_mu": 0.1}}


def _simulate(tmp_path: Path, tag: str, **fields: Any) -> tuple[dict[str, Any], dict]:
    config = parse_sim_config({"rounds": 2, "measure_memory": False, "workers": 1, **fields})
    summary = simulate(config, tmp_path / tag)
    with open_store(f"sqlite:///{tmp_path / tag / 'runs.db'}") as store:
        weights = store.resume(summary["run_id"]).weights["global"]  # type: ignore[union-attr]
        events = [(e.kind, e.detail) for e in store.events(summary["run_id"])]
    return summary | {"events": events}, weights


@pytest.mark.parametrize("method", ["local-loss", "splitfed"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_every_strategy_trains_two_rounds_with_mixed_cuts(
    tmp_path: Path, strategy: str, method: str
) -> None:
    summary, weights = _simulate(
        tmp_path, "run", method=method, strategy={"name": strategy, **_OPTIONS.get(strategy, {})}
    )
    cuts = {tuple(c["blocks"]) for c in summary["clients"]}
    assert len(cuts) == 2, f"the default profiles cut the cnn at two blocks: {cuts}"
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    assert all(np.isfinite(v).all() for v in weights.values())
    assert summary["final_accuracy"] > 0.3, summary["rounds"]  # chance is 0.1
    assert not [e for e in summary["events"] if e[0] == "round-failed"], summary["events"]
    if strategy in ("krum", "multikrum", "bulyan", "fedtrimmedavg"):
        # the server alone holds the deepest blocks: a group of one, named, not a traceback
        alone = [d for kind, d in summary["events"] if kind == "aggregation" and "alone" in d]
        assert alone and all("taken as it is" in d for d in alone), summary["events"]


def test_uniform_cuts_give_every_client_the_cut_the_smallest_can_hold(tmp_path: Path) -> None:
    summary, _ = _simulate(tmp_path, "uniform", cuts="uniform", rounds=1)
    cuts = {tuple(c["blocks"]) for c in summary["clients"]}
    assert cuts == {(0, 2)}, "the 64 MiB profile holds blocks [0, 2) at most"
    assert ("planned", "cuts " + str({c["name"]: 2 for c in summary["clients"]})) in summary[
        "events"
    ]
    assert summary["final_accuracy"] > 0.3, summary["rounds"]


def test_fedprox_is_fedavg_at_mu_0_and_differs_above(tmp_path: Path) -> None:
    _, fedavg = _simulate(tmp_path, "fedavg", strategy={"name": "fedavg"})
    _, zero = _simulate(tmp_path, "mu0", strategy={"name": "fedprox", "proximal_mu": 0.0})
    _, prox = _simulate(tmp_path, "mu1", strategy={"name": "fedprox", "proximal_mu": 1.0})
    assert fedavg.keys() == zero.keys() == prox.keys()
    assert all(np.array_equal(fedavg[k], zero[k]) for k in fedavg), "mu 0 is FedAvg, bit for bit"
    changed = [k for k in fedavg if not np.allclose(fedavg[k], prox[k], atol=1e-6)]
    assert any(k.startswith("block0.") for k in changed), "edges apply the proximal term"
    assert any(k.startswith("block5.") for k in changed), "and so does the GPU server"


@pytest.mark.parametrize("settings", [{"workers": 1}, {"workers": 2, "deterministic": True}])
def test_two_seeded_simulations_give_the_same_weights(
    tmp_path: Path, settings: dict[str, Any]
) -> None:
    first, a = _simulate(tmp_path, "a", seed=3, **settings)
    second, b = _simulate(tmp_path, "b", seed=3, **settings)
    assert [r["accuracy"] for r in first["rounds"]] == [r["accuracy"] for r in second["rounds"]]
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    _, other = _simulate(tmp_path, "c", seed=4, **settings)
    assert not all(np.array_equal(a[k], other[k]) for k in a), "the seed matters"


@pytest.mark.parametrize("settings", [{"workers": 1}, {"workers": 2, "deterministic": True}])
def test_a_model_with_dropout_gives_the_same_weights_twice(
    tmp_path: Path, settings: dict[str, Any]
) -> None:
    # the clients and the GPU server train in threads of one process; each draws its dropout
    # masks from its own stream (split_models.randomness), not from torch's one generator
    model = {"model": "tests.fixtures.user_models:with_dropout", "clients": 4, **settings}
    first, a = _simulate(tmp_path, "a", seed=3, **model)
    second, b = _simulate(tmp_path, "b", seed=3, **model)
    assert [r["accuracy"] for r in first["rounds"]] == [r["accuracy"] for r in second["rounds"]]
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_a_splitfed_batch_the_server_refuses_fails_the_round_at_once(tmp_path: Path) -> None:
    # every activation is above max_activation: the edges waited out the round's deadline
    # for gradients that never came (10 minutes a try); now the server tells them
    config = parse_sim_config(
        {
            "rounds": 1,
            "method": "splitfed",
            "measure_memory": False,
            "max_activation": 1e-6,
        }
    )
    # a deadline short enough that a test without the fix fails in minutes, not half an hour
    config = replace(config, training=replace(config.training, round_deadline_seconds=40.0))
    with pytest.raises(CoordinatorError, match=r"round 1 failed 3 times"):
        simulate(config, tmp_path / "run", run_id="refused")
    with open_store(f"sqlite:///{tmp_path / 'run' / 'runs.db'}") as store:
        reasons = [e.detail for e in store.events("refused") if e.kind == "round-failed"]
    assert len(reasons) == 3 and all("the GPU server refused batch" in r for r in reasons)
    assert all("max_activation" in r and "deadline" not in r for r in reasons), reasons


@pytest.mark.parametrize("method", ["local-loss", "splitfed", "fedavg"])
def test_a_batchnorm_model_trains_clients_whose_last_batch_would_hold_one_example(
    tmp_path: Path, method: str
) -> None:
    # 66 examples, 2 clients, batch 32: each client's epoch ended in a batch of one, which
    # BatchNorm refuses in training; every round failed
    rng = np.random.default_rng(0)
    y = np.arange(66) % 10
    x = (rng.standard_normal((66, 1, 8, 8)) + y[:, None, None, None]).astype(np.float32)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    np.savez(tmp_path / "test.npz", x=x[:20], y=y[:20])
    summary, _ = _simulate(
        tmp_path,
        "run",
        model="tests.fixtures.user_models:with_batchnorm",
        data=f"npz:{tmp_path / 'train.npz'}",
        test_data=f"npz:{tmp_path / 'test.npz'}",
        clients=2,
        batch_size=32,
        method=method,
    )
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    assert all(r["accuracy"] is not None for r in summary["rounds"])


def test_a_first_round_that_blows_up_is_not_committed(tmp_path: Path) -> None:
    # Flower's FedAdagrad step of 0.1 takes the cnn to a loss of hundreds in round 1
    config = parse_sim_config(
        {"rounds": 1, "measure_memory": False, "strategy": {"name": "fedadagrad", "eta": 0.1}}
    )
    with pytest.raises(CoordinatorError, match=r"round 1 failed 3 times.*lower the learning"):
        simulate(config, tmp_path / "run", run_id="blown")
    with open_store(f"sqlite:///{tmp_path / 'run' / 'runs.db'}") as store:
        reasons = [e.detail for e in store.events("blown") if e.kind == "round-failed"]
        ended = [e.detail for e in store.events("blown") if e.kind == "run-failed"]
        assert store.resume("blown") is None, "nothing committed"
    assert len(reasons) == 3, reasons  # judged against the initial weights' loss (about 3)
    assert all(re.search(r"evaluation loss jumped from [23]\.\d+ to \d{2,}", r) for r in reasons)
    # the run's end is an event too, naming the last try's reason
    assert len(ended) == 1 and f"(last: {reasons[-1]})" in ended[0], ended


@pytest.mark.parametrize("method", ["local-loss", "fedavg"])
def test_a_decaying_learning_rate_reaches_every_trainer(
    tmp_path: Path, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # round 1 trains at the full rate, round 2 of 2 at half with cosine decay: every step's
    # rate, seen by the front segments (edges) and the last (the GPU server's back, or a
    # whole-model client)
    from split_models.segment import Segment

    rates: dict[bool, set[float]] = {True: set(), False: set()}
    step = Segment._step

    def recording(segment: Segment) -> None:
        step(segment)
        rates[segment.is_last].add(round(segment.optimizer.param_groups[0]["lr"], 9))

    monkeypatch.setattr(Segment, "_step", recording)
    sgd = {"name": "sgd", "lr": 0.05}
    _, constant = _simulate(tmp_path, "constant", method=method, optimizer=sgd)
    assert rates[True] == {0.05}
    rates[True].clear(), rates[False].clear()
    _, decayed = _simulate(
        tmp_path, "decayed", method=method, optimizer={**sgd, "lr_decay": "cosine"}
    )
    assert rates[True] == {0.05, 0.025}, "the GPU server's back (or the client) decays"
    if method == "local-loss":
        assert rates[False] == {0.05, 0.025}, "and so do the edges"
    assert any(not np.array_equal(constant[k], decayed[k]) for k in constant)


def test_the_fedavg_baseline_takes_the_configured_strategy_and_sampling(tmp_path: Path) -> None:
    # found by a user-style trial: the whole-model baseline averaged with FedAvg whatever the
    # strategy said, and trained every client whatever fraction_train said
    runs = {
        name: _simulate(tmp_path, name, method="fedavg", clients=6, rounds=1, strategy=strategy)
        for name, strategy in {
            "fedavg": {"name": "fedavg"},
            "median": {"name": "fedmedian"},
            "half": {"name": "fedavg", "fraction_train": 0.5},
        }.items()
    }
    (fedavg, averaged), (_, median), (half, _) = runs["fedavg"], runs["median"], runs["half"]
    assert any(not np.array_equal(averaged[k], median[k]) for k in averaged)
    assert fedavg["rounds"][0]["participants"] == 6
    assert half["rounds"][0]["participants"] == 3, half["rounds"]


class _StopInRound(RoundObserver):
    """Interrupts the coordinator (as Ctrl-C does) once ``number``'s first devices answered."""

    def __init__(self, number: int) -> None:
        self.number, self.current = number, 0

    def round_started(self, number: int, devices: list[str]) -> None:
        self.current = number

    def device_answered(self, device: str) -> None:
        if self.current == self.number:
            raise KeyboardInterrupt


def test_a_deterministic_run_resumed_mid_round_gives_the_uninterrupted_weights(
    tmp_path: Path,
) -> None:
    settings: dict[str, Any] = {"seed": 3, "rounds": 3, "workers": 2, "deterministic": True}
    _, whole = _simulate(tmp_path, "whole", **settings)
    config = parse_sim_config({"measure_memory": False, **settings})
    with pytest.raises(RunCancelled):
        simulate(config, tmp_path / "cut", observer=_StopInRound(2))

    summary = simulate(config, tmp_path / "cut")  # the same command again resumes it

    with open_store(f"sqlite:///{tmp_path / 'cut' / 'runs.db'}") as store:
        resumed = store.resume(summary["run_id"]).weights["global"]  # type: ignore[union-attr]
        assert any(e.kind == "resumed" for e in store.events(summary["run_id"]))
    assert resumed.keys() == whole.keys()
    assert all(np.array_equal(resumed[k], whole[k]) for k in whole)


@pytest.mark.parametrize("mirror", [True, False])
def test_edges_cut_before_the_classifier_start_their_head_from_it(
    tmp_path: Path, mirror: bool
) -> None:
    """The default profiles cut the cnn at 2 and 5; cut 5 leaves only the classifier, which a
    linear head can be (``head_from_back``): those edges are sent the back's classifier as
    their head, and what they trained of it is averaged into the classifier as replicas of
    it (the stored head follows: coordinator.aggregation, ``mirrors``); with
    ``head_from_back: false`` the head is the edges' own and the classifier the server's."""
    optimizer = {"name": "adam", "lr": 1e-3, "head_lr_scale": 1e-6}
    fields = {"rounds": 1, "head_from_back": mirror, "optimizer": optimizer}
    config = parse_sim_config({"measure_memory": False, "workers": 1, **fields})
    summary, weights = _simulate(tmp_path, "mirror", **fields)
    assert {tuple(c["blocks"]) for c in summary["clients"]} == {(0, 2), (0, 5)}
    model = config.model.build(seed=config.training.seed)
    began = segment_state(Segment.from_model(model, 0, model.num_blocks))
    follows = [
        np.array_equal(weights[f"head5.net.1.{name}"], weights[f"block5.0.{name}"])
        for name in ("weight", "bias")
    ]
    assert follows == [mirror, mirror]
    moved = weights["block5.0.weight"] - began["block5.0.weight"]
    assert not np.allclose(moved, 0, atol=1e-3), "the server trained the classifier"
    assert summary["final_accuracy"] > 0.3, summary["rounds"]


@pytest.mark.parametrize(
    ("method", "strategy"),
    [("local-loss", "fedavg"), ("splitfed", "fedadam"), ("fedavg", "fedavg")],
)
def test_a_model_with_a_causal_mask_of_minus_infinity_trains(
    tmp_path: Path, method: str, strategy: str
) -> None:
    # the mask, a buffer of -inf, travelled as a weight: every reply failed the finite check
    # ("its training diverged"), and a server step would take -inf - -inf (NaN)
    summary, weights = _simulate(
        tmp_path,
        "run",
        model="tests.fixtures.user_models:causal",
        input_shape=[8, 8],
        method=method,
        strategy={"name": strategy},
    )
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    assert not [e for e in summary["events"] if e[0] == "round-failed"], summary["events"]
    assert summary["final_accuracy"] > 0.2, summary["rounds"]  # chance is 0.1
    assert weights and not [k for k in weights if k.endswith(".mask")], "built, not carried"
    assert all(np.isfinite(v).all() for v in weights.values())
