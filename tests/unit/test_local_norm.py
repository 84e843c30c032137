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
