"""One contract for every run-store backend: in-memory, SQLite file, PostgreSQL."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest

from storage import (
    DeviceRecord,
    DeviceResult,
    Event,
    InMemoryRunStore,
    Lease,
    LeaseLostError,
    MetricPoint,
    NotFoundError,
    RunStore,
    StateError,
    open_store,
)
from storage.records import utcnow

CONFIG = {"model": "cnn", "rounds": 3, "optimizer": {"name": "sgd", "lr": 0.1}}


def weights_for(round_number: int) -> dict[str, dict[str, np.ndarray]]:
    return {
        "edge-0-2": {"0.weight": np.full((4, 3), round_number, dtype=np.float32)},
        "server-2-6": {
            "2.weight": np.arange(6, dtype=np.float32) + round_number,
            "2.bias": np.zeros(2, dtype=np.float16),
        },
    }


class StoreContract:
    """Behaviour every backend must have. Subclasses provide the ``store`` fixture."""

    @pytest.fixture
    def store(self) -> Iterator[RunStore]:
        raise NotImplementedError

    def test_devices_upsert_with_their_status(self, store: RunStore) -> None:
        store.upsert_device(DeviceRecord("pi-01", "edge", 2**28, 2e9, 2.5e6, "secret/pi-01"))
        store.upsert_device(DeviceRecord("gpu-a", "gpu", 2**36, 1e14))
        store.upsert_device(
            DeviceRecord("pi-01", "edge", 2**29, 2e9, 2.5e6, "secret/pi-01", status="online")
        )
        pi = store.get_device("pi-01")
        assert pi.memory_bytes == 2**29 and pi.status == "online" and pi.last_seen is not None
        assert [d.name for d in store.list_devices()] == ["gpu-a", "pi-01"]
        with pytest.raises(NotFoundError):
            store.get_device("nope")
        with pytest.raises(ValueError, match="status"):
            store.upsert_device(DeviceRecord("pi-01", "edge", 2**29, 2e9, status="asleep"))

    def test_run_lifecycle_and_plan_versions(self, store: RunStore) -> None:
        run = store.create_run("demo-1", CONFIG, seed=7)
        with pytest.raises(StateError, match="no plan to revise"):
            store.set_plan("demo-1", {"edges": [0]}, revise=True)
        assert (run.status, run.seed, run.config, run.current_round) == ("created", 7, CONFIG, None)
        with pytest.raises(StateError, match="exists"):
            store.create_run("demo-1", CONFIG, seed=7)
        assert store.set_plan("demo-1", {"edges": [1]}) == 1
        assert store.set_plan("demo-1", {"edges": [2]}) == 2
        store.set_run_status("demo-1", "training")
        run = store.get_run("demo-1")
        assert run.plan == {"edges": [2]} and run.plan_version == 2 and run.status == "training"
        # a revision (speeds noted beside the same plan) replaces the document, not the version
        assert store.set_plan("demo-1", {"edges": [2], "measured": {"a": 1.0}}, revise=True) == 2
        revised = store.get_run("demo-1")
        assert (revised.plan, revised.plan_version) == ({"edges": [2], "measured": {"a": 1.0}}, 2)
        assert run.created_at.tzinfo is not None
        store.set_run_config("demo-1", {**CONFIG, "batch_size": 7})
        assert store.get_run("demo-1").config == {**CONFIG, "batch_size": 7}
        with pytest.raises(NotFoundError):
            store.set_run_config("missing", CONFIG)
        with pytest.raises(ValueError, match="status"):
            store.set_run_status("demo-1", "sleeping")
        with pytest.raises(NotFoundError):
            store.get_run("missing")

    def test_round_commit_and_resume(self, store: RunStore) -> None:
        store.create_run("r", CONFIG, seed=0)
        assert store.resume("r") is None
        store.open_round("r", 1, ["pi-01", "pi-02"])
        store.record_result(
            "r",
            1,
            DeviceResult(
                "pi-01",
                examples=100,
                loss=1.5,
                accuracy=0.4,
                bytes_sent=1000,
                bytes_received=500,
                wall_seconds=2.5,
                peak_memory_bytes=2**20,
            ),
        )
        store.record_result("r", 1, DeviceResult("pi-02", failure="deadline missed"))
        store.record_result("r", 1, DeviceResult("pi-01", examples=120, loss=1.2))  # replaces
        store.set_round_state("r", 1, "aggregating")
        optimizer = {"edge-0-2": {"0.weight.momentum": np.ones((4, 3), dtype=np.float32)}}
        record = store.commit_round(
            "r", 1, weights_for(1), optimizer, {"loss": 1.2}, {"accuracy": 0.55}
        )
        assert record.state == "committed" and record.evaluation == {"accuracy": 0.55}
        results = {r.device: r for r in store.get_round("r", 1).results}
        assert results["pi-01"].examples == 120 and results["pi-02"].failure == "deadline missed"
        state = store.resume("r")
        assert state is not None and state.round.number == 1
        assert state.participants == ("pi-01", "pi-02")
        for segment, tensors in weights_for(1).items():
            for name, array in tensors.items():
                restored = state.weights[segment][name]
                assert restored.dtype == array.dtype and np.array_equal(restored, array)
        assert np.array_equal(
            state.optimizer_states["edge-0-2"]["0.weight.momentum"],
            np.ones((4, 3), dtype=np.float32),
        )
        assert store.get_run("r").current_round == 1
        assert store.integrity_problems(deep=True) == []

    def test_committed_round_is_final_and_reopening_an_open_round_resets_it(
        self, store: RunStore
    ) -> None:
        store.create_run("r", CONFIG, seed=0)
        store.open_round("r", 1, ["a"])
        store.commit_round("r", 1, weights_for(1))
        with pytest.raises(StateError, match="committed already"):
            store.commit_round("r", 1, weights_for(1))
        with pytest.raises(StateError):
            store.open_round("r", 1, ["a"])
        with pytest.raises(StateError):
            store.record_result("r", 1, DeviceResult("a"))
        store.open_round("r", 2, ["a", "b"])
        store.record_result("r", 2, DeviceResult("a", examples=5))
        reopened = store.open_round("r", 2, ["b"])  # a retry after a failed round
        assert reopened.participants == ("b",) and reopened.results == ()
        with pytest.raises(StateError, match="commit_round"):
            store.set_round_state("r", 2, "committed")
        with pytest.raises(ValueError, match="weights"):
            store.commit_round("r", 2, {})
        assert [r.number for r in store.list_rounds("r")] == [1, 2]
        assert store.resume("r").round.number == 1  # type: ignore[union-attr]

    def test_record_results_in_one_call(self, store: RunStore) -> None:
        store.create_run("r", CONFIG, seed=0)
        store.open_round("r", 1, [f"d{i}" for i in range(50)])
        store.record_result("r", 1, DeviceResult("d3", examples=1))
        store.record_results("r", 1, [DeviceResult(f"d{i}", examples=i) for i in range(50)])
        results = store.get_round("r", 1).results
        assert len(results) == 50 and {r.device: r.examples for r in results}["d3"] == 3
        with pytest.raises(ValueError, match="counts"):
            store.record_results("r", 1, [DeviceResult("ok"), DeviceResult("bad", examples=-1)])
        assert len(store.get_round("r", 1).results) == 50, "a rejected batch changes nothing"

    def test_checkpoint_of_any_committed_round(self, store: RunStore) -> None:
        store.create_run("r", CONFIG, seed=0)
        for number in (1, 2):
            store.open_round("r", number, ["a"])
            store.commit_round("r", number, weights_for(number))
        store.open_round("r", 3, ["a"])
        first = store.checkpoint("r", 1)
        assert np.all(first.weights["edge-0-2"]["0.weight"] == 1)
        assert store.resume("r").round.number == 2  # type: ignore[union-attr]
        with pytest.raises(StateError, match="not committed"):
            store.checkpoint("r", 3)
        with pytest.raises(NotFoundError):
            store.checkpoint("r", 9)

    def test_bad_results_are_rejected(self, store: RunStore) -> None:
        store.create_run("r", CONFIG, seed=0)
        store.open_round("r", 1, ["a"])
        with pytest.raises(ValueError, match="counts"):
            store.record_result("r", 1, DeviceResult("a", examples=-1))
        with pytest.raises(NotFoundError):
            store.record_result("r", 9, DeviceResult("a"))

    def test_metrics_and_events(self, store: RunStore) -> None:
        store.create_run("r", CONFIG, seed=0)
        store.add_metrics(
            "r",
            [
                MetricPoint("loss", 2.0, round=1, device="pi-01"),
                MetricPoint("accuracy", 0.5, round=1),
            ],
        )
        store.add_metrics("r", [MetricPoint("loss", 1.0, round=2, device="pi-01")])
        assert [p.value for p in store.metrics("r", "loss")] == [2.0, 1.0]
        assert len(store.metrics("r")) == 3
        store.add_event("r", Event("device_joined", device="pi-01"))
        store.add_event(None, Event("message_rejected", "NaN in activations", device="pi-02"))
        assert [e.kind for e in store.events("r")] == ["device_joined"]
        assert [e.kind for e in store.events()] == ["device_joined", "message_rejected"]
        assert store.events()[1].at is not None
        silent = [Event("device-silent", "away", f"pi-0{i}", 2) for i in (3, 4)]
        store.add_events("r", silent)  # one transaction (SQL)
        assert [(e.device, e.round) for e in store.events("r")[1:]] == [("pi-03", 2), ("pi-04", 2)]
        assert all(e.at is not None for e in store.events("r"))

    def test_concurrent_writers_do_not_fail(self, store: RunStore) -> None:
        store.create_run("r", CONFIG, seed=0)
        errors: list[BaseException] = []

        def write(worker: int) -> None:
            try:
                for i in range(25):
                    store.add_metrics("r", [MetricPoint("loss", float(i), device=f"d{worker}")])
                    store.add_event("r", Event("tick", str(i), device=f"d{worker}"))
                    store.get_run("r")
            except BaseException as error:
                errors.append(error)

        threads = [threading.Thread(target=write, args=(w,)) for w in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert errors == []
        assert len(store.metrics("r")) == 6 * 25 and len(store.events("r")) == 6 * 25

    def test_a_lease_is_claimed_once_and_swapped_only_as_it_was_read(self, store: RunStore) -> None:
        assert store.claim_lease(lease("r", "a"))
        assert not store.claim_lease(lease("r", "b"))  # held
        first = store.lease("r")
        assert first is not None and (first.holder, first.host, first.pid) == ("a", "h-a", 11)
        assert store.renew_lease("r", "a")
        renewed = store.lease("r")
        assert renewed is not None and renewed.beats == first.beats + 1
        assert renewed.renewed_at >= first.renewed_at
        assert not store.claim_lease(lease("r", "b"), replacing=first)  # renewed since read
        assert store.claim_lease(lease("r", "b"), replacing=renewed)
        assert not store.renew_lease("r", "a")
        store.release_lease("r", "a")  # not a's any more: nothing happens
        held = store.lease("r")
        assert held is not None and held.holder == "b"
        assert [x.run_id for x in store.list_leases()] == ["r"]
        store.release_lease("r", "b")
        assert store.lease("r") is None and store.list_leases() == []

    def test_one_of_many_simultaneous_claims_wins(self, store: RunStore) -> None:
        won: list[str] = []
        barrier = threading.Barrier(6)

        def claim(name: str) -> None:
            barrier.wait()
            if store.claim_lease(lease("r", name)):
                won.append(name)

        threads = [threading.Thread(target=claim, args=(f"c{i}",)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        held = store.lease("r")
        assert len(won) == 1 and held is not None and held.holder == won[0]

    def test_a_fenced_commit_needs_the_lease(self, store: RunStore) -> None:
        store.create_run("r", CONFIG, seed=0)
        assert store.claim_lease(lease("r", "a"))
        store.fence("r", "a")
        store.open_round("r", 1, ["a"])
        store.commit_round("r", 1, weights_for(1))
        taken = store.lease("r")
        assert taken is not None and taken.beats >= 2  # the open and the commit renewed it
        store.open_round("r", 2, ["a"])
        taken = store.lease("r")
        assert taken is not None and store.claim_lease(lease("r", "b"), replacing=taken)
        with pytest.raises(LeaseLostError, match=r"taken over.*h-b"):
            store.commit_round("r", 2, weights_for(2))
        for write in (  # every write to the run: a stale coordinator changes nothing
            lambda: store.open_round("r", 2, ["b"]),
            lambda: store.record_result("r", 2, DeviceResult("a", examples=1)),
            lambda: store.set_run_status("r", "cancelled"),
            lambda: store.add_event("r", Event("cancelled", "a stale coordinator")),
            lambda: store.add_events("r", [Event("cancelled", "a stale coordinator")]),
            lambda: store.add_metrics("r", [MetricPoint("loss", 1.0)]),
        ):
            with pytest.raises(LeaseLostError):
                write()
        assert store.get_run("r").current_round == 1 and store.get_run("r").status == "created"
        assert store.get_round("r", 2).state == "open" and store.get_round("r", 2).results == ()
        assert store.events("r") == [] and store.metrics("r") == []
        store.fence("r", None)
        store.commit_round("r", 2, weights_for(2))
        assert store.get_run("r").current_round == 2


def lease(run_id: str, holder: str, age: float = 0.0) -> Lease:
    then = utcnow() - timedelta(seconds=age)
    return Lease(run_id, holder, f"h-{holder}", 11, 30.0, then, then)


@pytest.mark.unit
class TestInMemoryStore(StoreContract):
    @pytest.fixture
    def store(self) -> Iterator[RunStore]:
        yield InMemoryRunStore()


@pytest.mark.integration
class TestSqliteStore(StoreContract):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[RunStore]:
        with open_store(str(tmp_path / "runs.db")) as store:
            yield store


@pytest.mark.integration
class TestPostgresStore(StoreContract):
    @pytest.fixture
    def store(self, postgres_url: str, tmp_path: Path) -> Iterator[RunStore]:
        with open_store(postgres_url, tmp_path / "checkpoints") as store:
            yield store
