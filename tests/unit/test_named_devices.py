"""A run that names its devices plans with those alone, whoever else is on the broker (a
simulation on a shared broker took a deployed GPU server for its own)."""

from __future__ import annotations

import time

import pytest
from flwr.clientapp import ClientApp

from coordinator.config import DevicesConfig, RunConfig
from coordinator.devices import DeviceRegistry
from coordinator.errors import CoordinatorError
from split_models.errors import ConfigError
from wire.flower import TransportGrid, node_will
from wire.roles import Announcement, go_online
from wire.transport import InProcessHub

pytestmark = pytest.mark.unit


def _online(hub: InProcessHub, name: str, role: str) -> None:
    announcement = Announcement(name, role, 1 << 30, 1e10, 1e7)
    control = hub.connect(f"{name}-control", node_will(announcement.node_id, name))
    go_online(announcement, control, ClientApp())


def test_named_gpu_servers_are_the_only_ones_planned_with() -> None:
    hub = InProcessHub()
    coordinator = hub.connect("coordinator")
    grid = TransportGrid(coordinator)
    registry = DeviceRegistry(coordinator, grid)
    for name, role in (("e1", "edge"), ("e2", "edge"), ("gpu-a", "gpu"), ("gpu-sim", "gpu")):
        _online(hub, name, role)
    grid.wait_for_nodes(4, timeout=5)
    named = DevicesConfig(("e1",), ("gpu-sim",), 5.0)
    edges, servers = registry.wait(named)
    assert [e.device for e in edges] == ["e1"] and [s.device for s in servers] == ["gpu-sim"]
    counted = DevicesConfig(2, 1, 5.0)  # counts: the first by name
    edges, servers = registry.wait(counted)
    assert [e.device for e in edges] == ["e1", "e2"] and [s.device for s in servers] == ["gpu-a"]
    assert registry.missing(DevicesConfig(("e1",), ("gpu-b",), 5.0)) == ["gpu-b (never announced)"]


def test_gpu_servers_take_a_count_or_unique_names() -> None:
    base = {"run_id": "r", "model": "cnn", "input_shape": [1, 8, 8], "num_classes": 10}
    base |= {"rounds": 1}
    config = RunConfig.parse({**base, "devices": {"edges": 2, "gpu_servers": ["gpu-a", "gpu-b"]}})
    assert config.devices.gpu_servers == ("gpu-a", "gpu-b")
    assert RunConfig.parse(config.to_dict()).devices == config.devices  # stored and read back
    for bad in (0, ["gpu-a", "gpu-a"], [], "gpu-a"):
        with pytest.raises(ConfigError, match=r"devices\.gpu_servers"):
            RunConfig.parse({**base, "devices": {"edges": 2, "gpu_servers": bad}})


def test_waiting_for_devices_is_said_after_their_announcements_had_time_to_arrive(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Said at once, it named online devices 'missing' before their retained announcements
    arrived ("1 more GPU server(s); GPU server(s) online: none")."""
    hub = InProcessHub()
    coordinator = hub.connect("coordinator")
    now = [0.0]

    def sleep(seconds: float) -> None:
        now[0] += seconds
        time.sleep(0.01)  # the hub's deliveries run on their own threads
        if now[0] >= 1.0 and not registry.online("gpu"):  # the announcement comes after 1 s
            _online(hub, "gpu-a", "gpu")

    registry = DeviceRegistry(coordinator, TransportGrid(coordinator), lambda: now[0], sleep)
    _online(hub, "e1", "edge")
    deadline = time.monotonic() + 5
    while not registry.online("edge") and time.monotonic() < deadline:
        time.sleep(0.01)
    with caplog.at_level("INFO", logger="coordinator.devices"):
        _, servers = registry.wait(DevicesConfig(1, 1, 60.0))
    assert [s.device for s in servers] == ["gpu-a"] and now[0] >= 1.0
    assert "waiting for devices" not in caplog.text
    with (
        caplog.at_level("INFO", logger="coordinator.devices"),
        pytest.raises(CoordinatorError, match="waited 5 s"),
    ):
        registry.wait(DevicesConfig(1, 2, 5.0))  # one server never comes
    assert "waiting for devices: 1 more GPU server(s); GPU server(s) online: gpu-a" in caplog.text
