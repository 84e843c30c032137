"""``norm: recalibrate``: after each aggregation the edges measure the aggregate's BatchNorm
statistics on their data, so the committed model's statistics are those of its own features
on the clients' data; averaged ones (``norm: average``) are not."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional

from coordinator.recorder import WEIGHTS_SEGMENT
from simulation.config import parse_sim_config
from simulation.simulator import simulate
from storage import open_store

pytestmark = pytest.mark.integration

SHAPE = (3, 16, 16)


def _data(path: Path) -> np.ndarray:
    """Two clients whose inputs differ in scale and shift (as in FedBN's setting): averaging
    their statistics misses the spread between them."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 10, 240)
    x = rng.normal(0, 1, (240, *SHAPE)).astype(np.float32)
    x[120:] = 3 * x[120:] + 2
    np.savez(path, x=x, y=y)
    return x


def _first_norm(tmp_path: Path, method: str, norm: str) -> tuple[np.ndarray, ...]:
    """The committed stem convolution's output statistics on all the data, and the committed
    running mean and variance of the BatchNorm after it."""
    out = tmp_path / f"{method}-{norm}"
    out.mkdir()
    x = _data(out / "train.npz")
    config = {
        "model": "resnet8",
        "input_shape": list(SHAPE),
        "num_classes": 10,
        "data": f"npz:{out / 'train.npz'}",
        "test_fraction": 0.0001,
        "clients": 2,
        "partition": {"kind": "iid"},
        "rounds": 2,
        "batch_size": 16,
        "method": method,
        "cuts": "uniform",
        "measure_memory": False,
        "workers": 1,
        "norm": norm,
    }
    simulate(parse_sim_config(config), out)
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        (run,) = store.list_runs()
        state = store.resume(run.run_id)
        assert state is not None
        weights = state.weights[WEIGHTS_SEGMENT]
    with torch.no_grad():
        features = functional.conv2d(
            torch.from_numpy(x), torch.from_numpy(weights["block0.0.weight"]), padding=1
        )
    mean, var = features.mean((0, 2, 3)).numpy(), features.var((0, 2, 3)).numpy()
    return mean, var, weights["block0.1.running_mean"], weights["block0.1.running_var"]


@pytest.mark.parametrize("method", ["fedavg", "local-loss"])
def test_the_committed_statistics_are_the_aggregate_s_own(tmp_path: Path, method: str) -> None:
    mean, var, running_mean, running_var = _first_norm(tmp_path, method, "recalibrate")
    # the IID split gives each client both kinds of input; the union's moments, up to the
    # per-batch averaging of update_bn
    np.testing.assert_allclose(running_mean, mean, atol=0.05 * np.sqrt(var).max())
    np.testing.assert_allclose(running_var, var, rtol=0.1)
    mean, var, running_mean, running_var = _first_norm(tmp_path, method, "average")
    assert not np.allclose(running_var, var, rtol=0.1)
