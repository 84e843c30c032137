"""The coordinator's exceptions."""

from __future__ import annotations

__all__ = ["CoordinatorError"]


class CoordinatorError(RuntimeError):
    """The run cannot go on (devices missing, every attempt of a round failed...)."""
