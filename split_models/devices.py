"""Device declarations: edge devices and GPU servers with their memory, speed and uplink.

A device's ``memory`` is what is available to training tensors; the runtime's own resident size
(interpreter, torch libraries) is measured and reported separately (``split_models.measure``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from split_models.errors import ConfigError
from split_models.units import parse_bandwidth, parse_flops, parse_memory
from split_models.yamlfile import load_yaml

__all__ = ["DEVICE_KINDS", "DeviceSpec", "load_devices", "parse_devices"]

DEVICE_KINDS = ("edge", "gpu")
_REQUIRED = {
    "edge": ("name", "kind", "memory", "flops", "uplink"),
    "gpu": ("name", "kind", "memory", "flops"),
}
_KNOWN = {"name", "kind", "memory", "flops", "uplink"}


@dataclass(frozen=True)
class DeviceSpec:
    """One device: ``memory`` in bytes, ``flops`` in FLOP/s, ``uplink`` in bytes/s."""

    name: str
    kind: str
    memory: int
    flops: float
    uplink: float | None = None
    # an edge's batches a round (0: unknown): its segment's weights go down and up once a
    # round, which the partitioner spreads over them
    round_batches: int = 0

    def __post_init__(self) -> None:
        if self.kind not in DEVICE_KINDS:
            raise ConfigError(
                f"device {self.name!r}: kind {self.kind!r} is not one of {DEVICE_KINDS}"
            )
        if not self.name or not isinstance(self.name, str):
            raise ConfigError(f"device name must be a non-empty string, got {self.name!r}")

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any], where: str = "device") -> DeviceSpec:
        """Validate one entry of a devices file (units as strings or plain numbers)."""
        if not isinstance(data, Mapping):
            raise ConfigError(
                f"{where}: expected a mapping with name, kind, memory..., got {data!r}"
            )
        unknown = sorted(set(data) - _KNOWN)
        if unknown:
            raise ConfigError(
                f"{where}: unknown field(s) {unknown}; valid fields are {sorted(_KNOWN)}"
            )
        kind = data.get("kind")
        if kind not in DEVICE_KINDS:
            raise ConfigError(f"{where}.kind: expected one of {DEVICE_KINDS}, got {kind!r}")
        missing = [f for f in _REQUIRED[kind] if data.get(f) is None]
        if missing:
            raise ConfigError(f"{where}: missing field(s) {missing} for a {kind} device")
        name = str(data["name"])
        uplink = data.get("uplink")
        return cls(
            name=name,
            kind=kind,
            memory=parse_memory(data["memory"], f"{where} ({name}).memory"),
            flops=parse_flops(data["flops"], f"{where} ({name}).flops"),
            uplink=None if uplink is None else parse_bandwidth(uplink, f"{where} ({name}).uplink"),
        )


def parse_devices(data: object) -> list[DeviceSpec]:
    """Parse ``{"devices": [...]}`` (the devices file's content) into validated specs."""
    if not isinstance(data, Mapping) or "devices" not in data:
        raise ConfigError("devices file: expected a top-level 'devices:' list")
    entries = data["devices"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError("devices: expected a non-empty list of devices")
    devices = [DeviceSpec.from_mapping(e, f"devices[{i}]") for i, e in enumerate(entries)]
    seen: set[str] = set()
    for device in devices:
        if device.name in seen:
            raise ConfigError(
                f"devices: name {device.name!r} is declared twice; names must be unique"
            )
        seen.add(device.name)
    return devices


def load_devices(path: str | Path) -> list[DeviceSpec]:
    """Read and validate a devices YAML file."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"devices file {str(path)!r} cannot be read: {error.strerror}") from error
    try:
        return parse_devices(load_yaml(text))
    except yaml.YAMLError as error:
        raise ConfigError(f"devices file {str(path)!r} is not valid YAML: {error}") from error
