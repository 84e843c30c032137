"""The coordinator's exceptions."""

from __future__ import annotations

__all__ = ["CoordinatorError", "PlanRefused", "RunCancelled", "RunHeldError"]


class CoordinatorError(RuntimeError):
    """The run cannot go on (devices missing, every attempt of a round failed...)."""


class PlanRefused(CoordinatorError):
    """Every plan was refused by the edges for what they are (their memory, their data):
    the same config will be refused again, so a service manager must not restart into it
    (exit 2, like a config error). Edges that did not answer are not this."""


class RunHeldError(CoordinatorError):
    """Another coordinator, alive, drives the run (holds its lease)."""


class RunCancelled(KeyboardInterrupt):
    """The run was stopped and marked ``cancelled`` (resumable): ``requested`` by
    ``edgesplit runs stop``, else interrupted (``signum``: the signal, None for Ctrl-C in a
    Python session). A ``KeyboardInterrupt``, so no ``except Exception`` swallows it."""

    def __init__(self, message: str, requested: bool = False, signum: int | None = None) -> None:
        super().__init__(message)
        self.requested, self.signum = requested, signum

    def __str__(self) -> str:
        return str(self.args[0])
