"""Parsing and formatting of memory sizes, bandwidths and FLOP rates.

Memory: ``B, KiB, MiB, GiB, TiB`` (powers of 1024) and ``KB, MB, GB, TB`` (powers of 1000).
Bandwidth: ``bit/s`` multiples written ``Kbit, Mbit, Gbit`` (``/s`` optional) or bytes per second
written ``B, KB, MB, GB`` (``/s`` optional). A bare number means bytes (memory) or bytes/s
(bandwidth). FLOP rates are plain numbers (``2e9``).
"""

from __future__ import annotations

import math
import re

from split_models.errors import ConfigError

__all__ = [
    "MAX_DURATION_SECONDS",
    "format_bytes",
    "parse_bandwidth",
    "parse_duration",
    "parse_flops",
    "parse_memory",
]

MAX_DURATION_SECONDS = 7 * 24 * 3600.0  # the longest wait or deadline a config may ask for
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}

_MEMORY_UNITS = {
    "B": 1,
    "KIB": 1024,
    "MIB": 1024**2,
    "GIB": 1024**3,
    "TIB": 1024**4,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
    "TB": 1000**4,
}
_BANDWIDTH_UNITS = {
    "BIT": 1 / 8,
    "KBIT": 1000 / 8,
    "MBIT": 1000**2 / 8,
    "GBIT": 1000**3 / 8,
    "B": 1,
    "KB": 1000,
    "MB": 1000**2,
    "GB": 1000**3,
}
_QUANTITY = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)(?:/s)?\s*$")


def _split(field: str, value: object) -> tuple[float, str]:
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a number with a unit, got {value!r}")
    if isinstance(value, int | float):
        return float(value), ""
    if not isinstance(value, str):
        raise ConfigError(f"{field}: expected a number with a unit, got {value!r}")
    match = _QUANTITY.match(value)
    if match is None:
        raise ConfigError(f"{field}: cannot parse {value!r}; write e.g. '512MiB' or '20Mbit'")
    return float(match.group(1)), match.group(2).upper()


def _check_positive(field: str, value: object, number: float) -> float:
    if not math.isfinite(number) or number <= 0:
        raise ConfigError(f"{field}: must be a positive finite quantity, got {value!r}")
    return number


def parse_memory(value: object, field: str = "memory") -> int:
    """Return a memory size in bytes, e.g. ``parse_memory("256MiB") == 268435456``."""
    number, unit = _split(field, value)
    factor = _MEMORY_UNITS.get(unit or "B")
    if factor is None:
        valid = ", ".join(_MEMORY_UNITS)
        raise ConfigError(f"{field}: unknown memory unit {unit!r} in {value!r}; use one of {valid}")
    return int(_check_positive(field, value, number * factor))


def parse_bandwidth(value: object, field: str = "uplink") -> float:
    """Return a bandwidth in bytes per second, e.g. ``parse_bandwidth("20Mbit") == 2.5e6``."""
    number, unit = _split(field, value)
    factor = _BANDWIDTH_UNITS.get(unit or "B")
    if factor is None:
        valid = "Kbit, Mbit, Gbit (bits/s) or B, KB, MB, GB (bytes/s)"
        raise ConfigError(f"{field}: unknown bandwidth unit {unit!r} in {value!r}; use {valid}")
    return _check_positive(field, value, number * factor)


def parse_flops(value: object, field: str = "flops") -> float:
    """Return a sustained FLOP/s rate from a number or a numeric string such as ``"2e9"``."""
    number, unit = _split(field, value)
    if unit not in ("", "FLOPS", "FLOP"):
        raise ConfigError(f"{field}: expected a plain number of FLOP/s such as 2e9, got {value!r}")
    return _check_positive(field, value, number)


def format_bytes(count: float) -> str:
    """Format a byte count with a binary unit: ``format_bytes(1536) == '1.5 KiB'``."""
    size = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(size) < 1024 or unit == "GiB":
            return f"{size:.0f} B" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    raise AssertionError("unreachable")


def parse_duration(value: object, field_name: str) -> float:
    """Seconds from ``120``, ``"120s"``, ``"5m"``, ``"1h"`` or ``"500ms"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}: expected a duration such as 120s, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ConfigError(
                f"{field_name}: expected a duration such as 120s or 5m, got {value!r}"
            )
        seconds = float(match.group(1)) * _SECONDS[match.group(2)]
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(f"{field_name}: must be positive, got {value!r}")
    if seconds > MAX_DURATION_SECONDS:
        raise ConfigError(
            f"{field_name}: {value!r} is longer than the 7 days a wait or deadline may take"
        )
    return seconds
