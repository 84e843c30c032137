"""The round recorder on a real SQLite store: a round enters ``aggregating`` while the strategy
aggregates, and a commit collects the checkpoint files no committed round refers to."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ConfigRecord, Message, MetricRecord, RecordDict

from coordinator.aggregation import build_strategy
from coordinator.recorder import Outcome, RoundObserver, RoundRecorder
from coordinator.runner import EdgeView
from storage import open_store
from storage.records import DeviceResult
from storage.sql import SqlRunStore
from wire.flower import TransportGrid, array_record
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration

MODEL = {"block0.w": np.zeros(4, np.float32)}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqlRunStore]:
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as opened:
        if not isinstance(opened, SqlRunStore):
            raise TypeError(f"expected a SQL store, got {type(opened).__name__}")
        opened.create_run("rec", {}, seed=0)
        opened.open_round("rec", 1, ["pi-01"])
        yield opened


def _recorder(store: SqlRunStore, name: str = "fedavg", **options: object) -> RoundRecorder:
    strategy = build_strategy(name, min_available_nodes=1, min_train_nodes=1, **options)
    grid = EdgeView(TransportGrid(InProcessHub().connect("coordinator")), lambda: [1])
    strategy.configure_train(1, array_record(MODEL), ConfigRecord(), grid)  # notes the weights
    return RoundRecorder(store, "rec", strategy, RoundObserver(), rounds=1)


def _reply(content: dict[str, np.ndarray]) -> Message:
    template = Message(RecordDict(), dst_node_id=1, message_type="train")
    return Message(
        RecordDict({"arrays": array_record(content), "metrics": MetricRecord({"num-examples": 3})}),
        reply_to=template,
    )


def test_a_round_is_aggregating_while_the_strategy_aggregates(store: SqlRunStore) -> None:
    recorder = _recorder(store)
    content = {"block0.w": np.ones(4, np.float32)}

    merged = recorder.aggregate(1, [_reply(content)])

    assert merged is not None and np.array_equal(merged["block0.w"], content["block0.w"])
    assert [r.state for r in store.list_rounds("rec")] == ["aggregating"]


@pytest.mark.parametrize(
    ("name", "options"),
    [("fedavgm", {"server_momentum": 0.9}), ("fedadam", {"eta": 0.1}), ("fedyogi", {})],
)
def test_a_refused_try_leaves_the_server_optimizer_as_it_was(
    store: SqlRunStore, name: str, options: dict[str, object]
) -> None:
    # a try aggregated and then refused (it diverged) must not move FedAvgM's momentum and
    # current weights or FedOpt's moments: its retry aggregates as the first try did
    recorder = _recorder(store, name, **options)
    content = {"block0.w": np.arange(4, dtype=np.float32)}
    first = recorder.aggregate(1, [_reply(content)])
    recorder.failed(1, 1, 3, "not committed: the evaluation loss jumped")
    retry = recorder.aggregate(1, [_reply(content)])
    assert first is not None and retry is not None
    np.testing.assert_array_equal(retry["block0.w"], first["block0.w"])
    # committed, the state moves on: the next round's same update lands elsewhere
    outcome = Outcome([DeviceResult("pi-01", examples=3)], ["pi-01"], {}, time.monotonic())
    recorder.commit(1, retry, outcome, {"accuracy": 0.5})
    store.open_round("rec", 2, ["pi-01"])
    following = recorder.aggregate(2, [_reply(content)])
    assert following is not None
    assert not np.allclose(following["block0.w"], first["block0.w"])


def test_a_commit_collects_old_unreferenced_checkpoint_files(store: SqlRunStore) -> None:
    recorder = _recorder(store)
    old, _ = store.files.put({"w": np.full(3, 7.0)})  # left by a crash before its commit
    young, _ = store.files.put({"w": np.full(3, 8.0)})  # perhaps another writer's, in flight
    hours_ago = time.time() - 7200
    os.utime(store.files.path(old), (hours_ago, hours_ago))
    outcome = Outcome([DeviceResult("pi-01", examples=3)], ["pi-01"], {}, time.monotonic())

    recorder.commit(1, {"block0.w": np.ones(4, np.float32)}, outcome, {"accuracy": 0.5})

    assert not store.files.path(old).exists()
    assert store.files.path(young).exists()
    assert store.get_run("rec").current_round == 1
    assert store.integrity_problems(deep=True) == []


def test_a_fallback_that_holds_every_round_warns_once_and_is_stored_each_round(
    store: SqlRunStore, caplog: pytest.LogCaptureFixture
) -> None:
    # one replica of a group is too few for Krum: it is taken as it is every round; the
    # operator is warned once, and the run's events still say it for each round
    store.open_round("rec", 2, ["pi-01"])
    recorder = _recorder(store, "krum")
    content = {"block0.w": np.ones(4, np.float32)}
    with caplog.at_level("INFO", logger="coordinator.recorder"):
        for number in (1, 2):
            assert recorder.aggregate(number, [_reply(content)]) is not None
    notes = [e for e in store.events("rec") if e.kind == "aggregation"]
    assert [e.round for e in notes] == [1, 2], notes
    levels = [r.levelname for r in caplog.records if "taken as it is" in r.message]
    assert levels == ["WARNING", "INFO"], caplog.records
