"""FedBN (``norm: local``): every device keeps its own BatchNorm layers across rounds, in the
store, on resume and in its exported segment; the global model holds their average."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
import torch

from coordinator.export import export_run
from coordinator.recorder import LOCAL_PREFIX, WEIGHTS_SEGMENT
from simulation.config import parse_sim_config
from simulation.simulator import simulate
from split_models.config import ModelConfig
from split_models.segment import Segment
from split_models.weights import load_segment_state, norm_keys
from storage import open_store

pytestmark = pytest.mark.integration

SHAPE = (3, 16, 16)


def _data(path: Path) -> None:
    """Two feature distributions (FedBN's setting): the second client's inputs are scaled
    and shifted, so its BatchNorm statistics differ from the first's."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, 240)
    tint = np.linspace(-1, 1, 10, dtype=np.float32)[y][:, None, None, None]
    x = rng.normal(0, 1, (240, *SHAPE)).astype(np.float32) + tint
    x[120:] = 3 * x[120:] + 2
    np.savez(path, x=x, y=y)


def _simulate(tmp_path: Path, method: str, norm: str = "local", **extra: Any) -> dict[str, Any]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    _data(tmp_path / "train.npz")
    config = parse_sim_config(
        {
            "model": "resnet8",
            "input_shape": list(SHAPE),
            "num_classes": 10,
            "data": f"npz:{tmp_path / 'train.npz'}",
            "test_fraction": 0.0001,
            "clients": 2,
            "partition": {"kind": "iid"},
            "rounds": 2,
            "batch_size": 16,
            "method": method,
            "measure_memory": False,
            "workers": 1,
            "norm": norm,
        }
        | extra
    )
    return simulate(config, tmp_path / method)


def _last_checkpoint(tmp_path: Path, method: str) -> tuple[Any, dict[str, dict[str, np.ndarray]]]:
    store = open_store(f"sqlite:///{tmp_path / method / 'runs.db'}")
    (run,) = store.list_runs()
    state = store.resume(run.run_id)
    assert state is not None
    return store, state.weights


def test_split_devices_keep_their_own_batchnorm_and_export_it(tmp_path: Path) -> None:
    summary = _simulate(tmp_path, "local-loss", cuts="uniform")  # one cut, two own models
    shares = {c["name"]: c["examples"] for c in summary["clients"]}
    store, segments = _last_checkpoint(tmp_path, "local-loss")
    with store:
        model = ModelConfig("resnet8", SHAPE, 10).build(seed=0)
        bn = norm_keys(Segment.from_model(model, 0, model.num_blocks))
        local = {k.removeprefix(LOCAL_PREFIX): v for k, v in segments.items() if k != "global"}
        assert {"client-000", "client-001", "gpu-sim"} <= set(local)
        for tensors in local.values():
            assert tensors and set(tensors) <= bn  # only BatchNorm tensors are kept apart
        mine, theirs = local["client-000"], local["client-001"]
        shared = sorted(set(mine) & set(theirs) & {k for k in bn if k.endswith("running_mean")})
        assert shared, "the two clients hold no BatchNorm layer in common"
        key = shared[0]
        assert not np.allclose(mine[key], theirs[key], atol=1e-3)  # their own statistics
        # the global model holds the example-weighted mean
        a, b = shares["client-000"], shares["client-001"]
        np.testing.assert_allclose(
            segments[WEIGHTS_SEGMENT][key], (a * mine[key] + b * theirs[key]) / (a + b), atol=1e-5
        )
        (run,) = store.list_runs()
        results = export_run(store, run.run_id, tmp_path / "onnx", per_device=True)
    assert all(r.ok for r in results), [(r.name, r.max_abs_diff) for r in results]
    # one result per edge, each its own (devices of one cut once reported the first's)
    devices = sorted(
        r.name.rsplit("-", 2)[-2] + "-" + r.name.rsplit("-", 1)[-1] for r in results[1:]
    )
    assert devices == sorted(shares), devices
    assert len({r.path for r in results}) == len(results)
    device = next(r for r in results if r.name.endswith("client-001"))
    # the exported segment computes with client-001's statistics, not the average's
    segment = Segment.from_model(model, 0, device.blocks[1])
    load_segment_state(segment, segments[WEIGHTS_SEGMENT])
    x = torch.randn(4, *SHAPE)
    with torch.no_grad():
        averaged = segment.module.eval()(x).numpy()
    session = ort.InferenceSession(str(device.path), providers=["CPUExecutionProvider"])
    (exported,) = session.run(None, {session.get_inputs()[0].name: x.numpy()})
    assert not np.allclose(exported, averaged, atol=1e-4)


def test_fedavg_keeps_each_clients_batchnorm_and_average_does_not(tmp_path: Path) -> None:
    _simulate(tmp_path / "local", "fedavg")
    store, segments = _last_checkpoint(tmp_path / "local", "fedavg")
    store.close()
    assert {"local:client-000", "local:client-001"} <= set(segments)
    _simulate(tmp_path / "average", "fedavg", norm="average")
    store, segments = _last_checkpoint(tmp_path / "average", "fedavg")
    store.close()
    assert set(segments) == {WEIGHTS_SEGMENT}


def test_a_resumed_run_refuses_a_changed_norm(tmp_path: Path) -> None:
    from coordinator.config import RunConfig
    from coordinator.service import Coordinator
    from split_models.errors import ConfigError
    from wire.transport import InProcessHub

    def config(norm: str) -> RunConfig:
        return RunConfig.parse(
            {
                "run_id": "bn",
                "model": "resnet8",
                "input_shape": list(SHAPE),
                "num_classes": 10,
                "devices": {"edges": ["pi-01"], "gpu_servers": 1, "wait": "1s"},
                "rounds": 1,
                "norm": norm,
            }
        )

    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        store.create_run("bn", config("average").to_dict(), 0)
        # a round trained with averaged norms (a run that committed none starts over freely)
        store.open_round("bn", 1, ["pi-01"])
        store.commit_round("bn", 1, {WEIGHTS_SEGMENT: {"w": np.zeros(1, np.float32)}})
        with pytest.raises(ConfigError, match="norm"):
            Coordinator(config("local"), store, InProcessHub().connect("c")).run()
