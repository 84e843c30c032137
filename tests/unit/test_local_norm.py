"""FedBN bookkeeping of the round recorder: which copy of a BatchNorm layer a device gets."""

from __future__ import annotations

import numpy as np
import pytest

from coordinator.recorder import LOCAL_PREFIX, WEIGHTS_SEGMENT, RoundObserver, RoundRecorder

pytestmark = pytest.mark.unit


KEYS = frozenset({"block0.1.running_mean"})


def _recorder() -> RoundRecorder:
    recorder = RoundRecorder(None, "run", None, RoundObserver())  # type: ignore[arg-type]
    recorder.keep_local(KEYS)
    return recorder


def test_a_device_gets_its_own_copy_of_local_tensors_and_the_global_rest() -> None:
    recorder = _recorder()
    mine = np.full(3, 7.0, dtype=np.float32)
    recorder.keep_local(
        KEYS,
        {
            WEIGHTS_SEGMENT: {"block0.1.running_mean": np.zeros(3, dtype=np.float32)},
            LOCAL_PREFIX + "pi-01": {"block0.1.running_mean": mine},
        },
    )
    assert set(recorder.local) == {"pi-01"}
    weights = {
        "block0.1.running_mean": np.zeros(3, dtype=np.float32),
        "block0.0.weight": np.ones(2, dtype=np.float32),
    }
    sent = recorder.own("pi-01", weights)
    np.testing.assert_array_equal(sent["block0.1.running_mean"], mine)
    np.testing.assert_array_equal(sent["block0.0.weight"], weights["block0.0.weight"])
    # a device that has not trained yet starts from the global average
    fresh = recorder.own("pi-02", weights)
    np.testing.assert_array_equal(fresh["block0.1.running_mean"], np.zeros(3))


def test_the_round_being_aggregated_is_evaluated_with_the_copies_just_trained() -> None:
    from types import SimpleNamespace

    from wire.flower import array_record

    recorder = _recorder()
    trained = np.full(3, 5.0, dtype=np.float32)
    arrays = {"block0.1.running_mean": trained, "block0.0.weight": np.ones(2, np.float32)}
    reply = SimpleNamespace(content=SimpleNamespace(array_records={"a": array_record(arrays)}))
    recorder._pending = recorder._trained_local([reply], ["pi-01"])  # type: ignore[list-item]
    weights = {"block0.1.running_mean": np.zeros(3, np.float32)}
    np.testing.assert_array_equal(
        recorder.own("pi-01", weights, trained=True)["block0.1.running_mean"], trained
    )
    # not committed yet: the next round's train message would still carry the committed copy
    np.testing.assert_array_equal(recorder.own("pi-01", weights)["block0.1.running_mean"], 0)
    assert set(recorder._pending["pi-01"]) == {"block0.1.running_mean"}  # BatchNorm only


def test_a_new_plan_drops_the_own_copies_of_blocks_a_device_gives_up() -> None:
    recorder = _recorder()
    copy = {
        k: np.full(2, float(i), dtype=np.float32)
        for i, k in enumerate(
            ["block0.1.running_mean", "block3.1.running_mean", "head3.1.running_mean"]
        )
    }
    recorder.local = {"pi-01": dict(copy), "pi-02": dict(copy), "pi-03": dict(copy)}
    # pi-01 now holds [0, 2) (its head at cut 2), pi-02 [0, 4) (its head now at cut 4, so
    # its copy of head 3 goes), pi-03 is not planned
    recorder.replanned({"pi-01": (0, 2, 2), "pi-02": (0, 4, 4), "gpu-a": (2, 6, None)})
    kept = {device: sorted(own) for device, own in recorder.local.items()}
    assert kept == {
        "pi-01": ["block0.1.running_mean"],
        "pi-02": ["block0.1.running_mean", "block3.1.running_mean"],
    }
    # when a later plan hands block 3 back, pi-01 starts from the shared copy, not its old one
    shared = {"block3.1.running_mean": np.full(2, 9.0, dtype=np.float32)}
    np.testing.assert_array_equal(recorder.own("pi-01", shared)["block3.1.running_mean"], 9.0)


def test_devices_of_one_span_share_a_record_and_one_with_own_copies_gets_its_own() -> None:
    """The coordinator encodes a round's weights once per span (1,000 clients, two cuts: two
    records), except for a device that keeps its own BatchNorm copies."""
    from coordinator.recorder import device_records as _records
    from wire.flower import array_numpy

    recorder = _recorder()
    mine = np.full(3, 7.0, dtype=np.float32)
    recorder.keep_local(KEYS, {LOCAL_PREFIX + "pi-01": {"block0.1.running_mean": mine}})
    weights = {
        "block0.1.running_mean": np.zeros(3, dtype=np.float32),
        "block0.0.weight": np.ones(2, dtype=np.float32),
        "block1.0.weight": np.ones(4, dtype=np.float32),
    }
    spans = {"pi-01": (0, 1, 1), "pi-02": (0, 1, 1), "pi-03": (0, 1, 1), "gpu": (1, 2, None)}
    arrays_for = _records(recorder, weights, spans, {})
    assert arrays_for("pi-02") is arrays_for("pi-03")
    assert arrays_for("pi-01") is not arrays_for("pi-02")
    mean = "block0.1.running_mean"
    np.testing.assert_array_equal(array_numpy(arrays_for("pi-01")[mean]), mine)
    np.testing.assert_array_equal(array_numpy(arrays_for("pi-02")[mean]), 0)
    assert set(arrays_for("gpu")) == {"block1.0.weight"}
    assert set(arrays_for("pi-02")) == {mean, "block0.0.weight"}
