"""``require_device``: a device torch cannot train on here is a clear error naming its key."""

from __future__ import annotations

import pytest
import torch

from simulation.config import parse_sim_config
from split_models.errors import ConfigError
from split_models.runtime import require_device


def test_the_cpu_is_always_there() -> None:
    require_device("cpu", "client_device")


def test_a_cuda_index_past_the_devices_names_the_key_and_the_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    require_device("cuda", "gpu.device")
    require_device("cuda:1", "gpu.device")
    with pytest.raises(ConfigError, match=r"gpu.device: cuda:2, but torch sees 2 CUDA device"):
        require_device("cuda:2", "gpu.device")


def test_no_cuda_at_all(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"client_device: cuda, but torch sees no CUDA device"):
        require_device("cuda", "client_device")


def test_mps_where_torch_has_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"--device: mps, but torch has no MPS device"):
        require_device("mps", "--device")


def test_the_gpu_servers_device_is_a_simulation_key_that_round_trips() -> None:
    config = parse_sim_config({"gpu": {"device": "cuda:1"}})
    assert config.gpu.device == "cuda:1"
    assert config.to_dict()["gpu"]["device"] == "cuda:1"
    assert parse_sim_config(config.to_dict()) == config
    assert parse_sim_config(None).gpu.device == "cpu"


@pytest.mark.parametrize("device", ["tpu", "cuda:x", "cuda:", "cpu:0", "", "CUDA"])
def test_a_name_that_is_no_device_is_refused_naming_the_choices(device: str) -> None:
    # found by a user-style trial: `gpu-server --device tpu` announced itself and went online
    with pytest.raises(ConfigError, match=r"--device: .* is not a device; use cpu, cuda, cuda:N"):
        require_device(device, "--device")
