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
from tests.integration.test_fedbn import _last_checkpoint, _simulate

pytestmark = pytest.mark.integration


def _first_norm(tmp_path: Path, method: str, norm: str) -> tuple[np.ndarray, ...]:
    """The committed stem convolution's output statistics on all the data (FedBN's test data:
    half the inputs scaled and shifted), and the committed running mean and variance of the
    BatchNorm after it."""
    out = tmp_path / norm
    _simulate(out, method, norm, cuts="uniform")
    store, segments = _last_checkpoint(out, method)
    store.close()
    weights = segments[WEIGHTS_SEGMENT]
    with np.load(out / "train.npz") as data:
        x = torch.from_numpy(data["x"])
    with torch.no_grad():
        features = functional.conv2d(x, torch.from_numpy(weights["block0.0.weight"]), padding=1)
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
