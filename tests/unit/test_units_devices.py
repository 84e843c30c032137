"""Units and the devices file."""

from __future__ import annotations

from pathlib import Path

import pytest

from split_models.devices import load_devices, parse_devices
from split_models.errors import ConfigError
from split_models.units import format_bytes, parse_bandwidth, parse_flops, parse_memory

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("256MiB", 256 * 2**20),
        ("2GiB", 2 * 2**30),
        ("1.5KiB", 1536),
        ("512", 512),
        ("64KB", 64_000),
        ("1GB", 10**9),
        ("3 B", 3),
        (4096, 4096),
    ],
)
def test_parse_memory(text: object, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("20Mbit", 2.5e6), ("1Gbit/s", 1.25e8), ("10MB", 1e7), ("8Kbit", 1000.0), (100, 100.0)],
)
def test_parse_bandwidth(text: object, expected: float) -> None:
    assert parse_bandwidth(text) == expected


@pytest.mark.parametrize("bad", ["12 parsecs", "MiB", "-5MiB", "0", True, None, "1e400GiB"])
def test_bad_memory_is_rejected_with_field(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"devices\[3\]\.memory"):
        parse_memory(bad, "devices[3].memory")


def test_bad_bandwidth_and_flops_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"uplink.*unknown bandwidth unit 'MIB'"):
        parse_bandwidth("5MiB", "uplink")
    with pytest.raises(ConfigError, match="flops"):
        parse_flops("fast", "flops")
    assert parse_flops("2e9") == 2e9


def test_format_bytes() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.5 KiB"
    assert format_bytes(3 * 2**30) == "3.0 GiB"


def test_devices_file_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "devices.yaml"
    path.write_text(
        "devices:\n"
        "  - {name: pi-01, kind: edge, memory: 256MiB, flops: 2e9, uplink: 20Mbit}\n"
        "  - {name: gpu-a, kind: gpu, memory: 80GiB, flops: 1e14}\n"
    )
    edge, gpu = load_devices(path)
    assert (edge.name, edge.kind, edge.memory, edge.flops, edge.uplink) == (
        "pi-01",
        "edge",
        256 * 2**20,
        2e9,
        2.5e6,
    )
    assert (gpu.kind, gpu.memory, gpu.uplink) == ("gpu", 80 * 2**30, None)


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (
            {"name": "a", "kind": "edge", "memory": "1MiB", "flops": 1e9},
            r"missing field\(s\) \['uplink'\]",
        ),
        ({"name": "a", "kind": "phone", "memory": "1MiB", "flops": 1}, "kind: expected one of"),
        ({"name": "a", "kind": "gpu", "memory": "1MiB", "flops": 1, "colour": 1}, "unknown field"),
        (
            {"name": "a", "kind": "gpu", "memory": "1 lots", "flops": 1},
            r"devices\[0\] \(a\).memory",
        ),
    ],
)
def test_bad_device_entries_name_the_problem(entry: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_devices({"devices": [entry]})


def test_duplicate_names_and_empty_files_are_rejected(tmp_path: Path) -> None:
    gpu = {"name": "g", "kind": "gpu", "memory": "1GiB", "flops": 1e12}
    with pytest.raises(ConfigError, match="declared twice"):
        parse_devices({"devices": [gpu, gpu]})
    with pytest.raises(ConfigError, match="top-level 'devices:'"):
        parse_devices({"machines": []})
    with pytest.raises(ConfigError, match="cannot be read"):
        load_devices(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("devices: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_devices(broken)


def test_a_gpu_server_measures_its_speed_on_a_cpu_and_declares_an_accelerators() -> None:
    """A CPU server declaring 1e13 (the old default) was planned 1,000 times faster than it
    ran; the re-plan from its measured steps then moved every edge's cut in round 2."""
    from gpu_server.command import _flops

    measured = _flops("auto", "cpu")
    assert 1e6 < measured < 1e13, measured
    assert _flops("auto", "cuda:0") == 1e13
    assert _flops("2.5e12", "cpu") == 2.5e12
