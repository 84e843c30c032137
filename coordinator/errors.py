"""The coordinator's exceptions."""

from __future__ import annotations

__all__ = ["CoordinatorError", "RunCancelled"]


class CoordinatorError(RuntimeError):
    """The run cannot go on (devices missing, every attempt of a round failed...)."""


class RunCancelled(KeyboardInterrupt):
    """The run was stopped and marked ``cancelled`` (resumable): ``requested`` by
    ``edgesplit runs stop``, else interrupted (``signum``: the signal, None for Ctrl-C in a
    Python session). A ``KeyboardInterrupt``, so no ``except Exception`` swallows it."""

    def __init__(self, message: str, requested: bool = False, signum: int | None = None) -> None:
        super().__init__(message)
        self.requested, self.signum = requested, signum

    def __str__(self) -> str:
        return str(self.args[0])
