"""Exceptions raised by the split core. Each carries a message that names the value and the fix."""

from __future__ import annotations

__all__ = [
    "ConfigError",
    "InfeasiblePlanError",
    "ModelError",
    "ServersTooSmall",
    "SplitError",
]


class SplitError(Exception):
    """Base class for every error of the split core."""


class ConfigError(SplitError, ValueError):
    """A configuration value is missing, malformed or out of range."""


class ModelError(SplitError):
    """A model cannot be built, loaded or split."""


class InfeasiblePlanError(SplitError):
    """No assignment of segments to devices satisfies the memory budgets."""


class ServersTooSmall(InfeasiblePlanError):
    """The GPU servers cannot hold the back of the model, however the edges are cut."""
