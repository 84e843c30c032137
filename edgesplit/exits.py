"""What the ``edgesplit`` command tells the shell: one exit code per kind of failure and one
line on stderr with the cause and the fix (``EDGESPLIT_TRACEBACK=1`` adds the traceback).

| code | meaning |
|---|---|
| 0 | done; also a run stopped by ``edgesplit runs stop`` |
| 1 | runtime failure: the run failed, a file could not be written, an unexpected error |
| 2 | configuration or usage: a bad flag, config file, model, plan or run id; refused plans |
| 3 | a service is unreachable: the MQTT broker or the database server |
| 130 | interrupted by Ctrl-C (SIGINT); 143: terminated (SIGTERM); 129: hung up (SIGHUP) |
"""

from __future__ import annotations

import os
import signal
import sys
import traceback
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from types import FrameType

__all__ = [
    "EXIT_FAILURE",
    "EXIT_OK",
    "EXIT_UNREACHABLE",
    "EXIT_USAGE",
    "Signalled",
    "exit_for",
    "quiet_broken_pipe",
    "signals_interrupt",
    "wants_traceback",
]

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_UNREACHABLE = 0, 1, 2, 3
TRACEBACK_ENV = "EDGESPLIT_TRACEBACK"


class Signalled(KeyboardInterrupt):
    """SIGTERM or SIGHUP (or SIGINT) arrived: raised in the main thread like Ctrl-C, so
    ``finally`` blocks and the coordinator's cancellation run."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


STOPPING = (
    b"edgesplit: stopping already (saving the run's state so it can resume); "
    b"signal once more to quit at once\n"
)


class _Interrupts:
    """The first signal raises :class:`Signalled`; the second is absorbed, so the stop the
    first began can record the run as cancelled (Ctrl-C pressed twice, or ``timeout``
    signalling the process and its group at once, used to interrupt that write and leave
    the run neither cancelled nor resumable); a third raises again, for a stop that hangs."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self, signum: int, _frame: FrameType | None) -> None:
        self.count += 1
        if self.count == 2:
            os.write(2, STOPPING)  # stderr; no logging: its locks may be held
            return
        raise Signalled(signum)


@contextmanager
def quiet_broken_pipe(wanted: bool = True) -> Iterator[None]:
    """SIGPIPE's default action within the block (``wanted``): ``edgesplit status | head``
    ends quietly. Networked commands keep it ignored (a write to a broker that just went
    away is a lost connection, which paho reconnects, not a death). The handler in place
    before comes back after the block: left at the default, a caller in the same process
    (a test worker) died silently at its next write to a socket its peer had closed."""
    pipe = getattr(signal, "SIGPIPE", None)
    previous = signal.signal(pipe, signal.SIG_DFL) if wanted and pipe is not None else None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(pipe, previous)


@contextmanager
def signals_interrupt(
    signums: tuple[int, ...] = tuple(
        getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name)
    ),
) -> Iterator[None]:
    """Within the block, the first of ``signums`` to arrive raises :class:`Signalled` in the
    main thread, the second is absorbed while the stop runs, a third raises again."""
    handler = _Interrupts()
    previous = {s: signal.signal(s, handler) for s in signums}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _signal_code(signum: int | None) -> int:
    return 128 + (signum or signal.SIGINT)


def _classify(error: BaseException) -> tuple[int, str]:
    """The exit code of ``error`` and its line's prefix."""
    from coordinator.errors import CoordinatorError, PlanRefused, RunCancelled
    from split_models.errors import SplitError
    from storage.errors import NotAStoreError, NotFoundError, StoreError, UsageError
    from storage.errors import UnreachableError as DatabaseUnreachable
    from wire.errors import RefusedError, TransportError
    from wire.errors import UnreachableError as BrokerUnreachable

    if isinstance(error, RunCancelled):
        return (EXIT_OK if error.requested else _signal_code(error.signum)), ""
    if isinstance(error, KeyboardInterrupt):
        return _signal_code(getattr(error, "signum", None)), "interrupted"
    if isinstance(error, DatabaseUnreachable | BrokerUnreachable):
        return EXIT_UNREACHABLE, "unreachable"
    if isinstance(error, SplitError | NotFoundError | NotAStoreError | UsageError | RefusedError):
        return EXIT_USAGE, "error"
    if isinstance(error, PlanRefused):
        return EXIT_USAGE, "error"
    if isinstance(error, StoreError | TransportError | CoordinatorError):
        return EXIT_FAILURE, "error"
    if isinstance(error, OSError):
        return EXIT_FAILURE, "error"
    name = type(error).__name__
    return EXIT_FAILURE, f"unexpected {name} (set {TRACEBACK_ENV}=1 for the traceback, report it)"


def exit_for(command: str, error: BaseException, show_traceback: bool = False) -> int:
    """Print ``error`` as one line on stderr (after its traceback with ``show_traceback``)
    and return its exit code."""
    code, prefix = _classify(error)
    if show_traceback:
        traceback.print_exception(error, file=sys.stderr)
    line = f"edgesplit {command}: " + (f"{prefix}: " if prefix else "") + _one_line(error)
    print(line + _resume_hint(command, error), file=sys.stderr, flush=True)
    return code


def _resume_hint(command: str, error: BaseException) -> str:
    """For a coordinator whose database went away: that the same command resumes the run."""
    from storage.errors import UnreachableError

    if command != "coordinator" or not isinstance(error, UnreachableError):
        return ""
    return "; run the same command again once it answers: the run resumes from its last round"


def _one_line(error: BaseException) -> str:
    """The description on one line; a list under a heading (``"  - item"`` lines) numbered."""
    head, *rest = _describe(error).splitlines() or [""]
    items = [line.strip().removeprefix("- ") for line in rest if line.strip()]
    return " ".join([head, *(f"({i}) {item}" for i, item in enumerate(items, 1))])


def wants_traceback(environ: Mapping[str, str], verbose: bool = False) -> bool:
    """``--verbose`` or ``EDGESPLIT_TRACEBACK=1``: print the traceback of a failure too."""
    return verbose or environ.get(TRACEBACK_ENV, "") not in ("", "0")


def _describe(error: BaseException) -> str:
    if type(error) is KeyboardInterrupt:
        return "SIGINT"
    if isinstance(error, Signalled):
        return signal.Signals(error.signum).name
    if isinstance(error, OSError) and error.filename is not None:
        fix = "check the path and its permissions, or choose another"
        return f"cannot use {error.filename}: {error.strerror or error}; {fix}"
    return str(error)
