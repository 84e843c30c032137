"""Configuration errors for unknown keys, naming where a key a section does not take belongs."""

from __future__ import annotations

from collections.abc import Collection

from split_models.config import _fields, _key, _section_type, config_keys
from split_models.errors import ConfigError

__all__ = ["unknown_keys"]


def unknown_keys(cls: type, where: str, unknown: list[str], valid: Collection[str]) -> ConfigError:
    """The error for ``unknown`` keys of ``cls`` at ``where``; for each that a section nested
    in it takes (``lr`` written beside ``optimizer`` instead of in it), where it belongs."""
    hints = "".join(f"; {k} belongs in {s}: {{{k}: ...}}" for k, s in _homes(cls, unknown).items())
    return ConfigError(
        f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(sorted(valid))}{hints}"
    )


def _homes(cls: type, unknown: list[str]) -> dict[str, str]:
    """The unknown keys that a section nested in ``cls`` takes -> that section's key. A
    section read by its own parser names what it takes with an ``option_keys()`` method."""
    found: dict[str, str] = {}
    for spec in _fields(cls):
        section = _section_type(cls, spec)
        if section is None:
            continue
        if spec.metadata.get("flat"):
            found.update(_homes(section, unknown))  # its keys sit beside the parent's
            continue
        listed = getattr(section, "option_keys", None)
        keys = set(listed()) if callable(listed) else config_keys(section)
        found.update({key: _key(spec) for key in unknown if key in keys})
    return found
