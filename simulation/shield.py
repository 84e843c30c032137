"""Signals that wait while a finished run's outputs are written.

Once the coordinator has marked a run finished, a run of the same command starts a new run:
a SIGTERM or Ctrl-C that stopped ``simulate`` while it wrote ``summary.json`` and the rest
would lose them for good. From :meth:`HeldSignals.hold` to the end of its block, the first
two SIGINT, SIGTERM or SIGHUP wait (a note on stderr says so; ``timeout`` signals a process
and its group at once) and are handed to the handler that was in place when the block ends;
a third is handed over at once, for a write that hangs. ``edgesplit simulate`` holds them
until its table is printed, then exits 0: the run it was asked to stop had finished. Outside
the main thread (where Python cannot set handlers) nothing is held.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import Any

__all__ = ["HeldSignals", "held_signals"]

_SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))
_NOTE = (
    b"edgesplit: the run has finished; writing its outputs before stopping "
    b"(signal twice more to quit at once)\n"
)


class HeldSignals:
    """Hold signals from :meth:`hold` on; :func:`held_signals` hands them over at its end."""

    def __init__(self) -> None:
        self.waiting: list[int] = []
        self._previous: dict[int, Any] = {}

    def hold(self) -> None:
        """From now on, signals wait (a no-op outside the main thread, or held already)."""
        if self._previous or threading.current_thread() is not threading.main_thread():
            return
        self._previous = {s: signal.signal(s, self._arrived) for s in _SIGNALS}

    def _arrived(self, signum: int, frame: FrameType | None) -> None:
        self.waiting.append(signum)
        if len(self.waiting) == 1:
            os.write(2, _NOTE)  # no logging: a signal handler may interrupt its locks
        elif len(self.waiting) > 2:
            _deliver(self._previous[signum], signum, frame)

    def release(self, deliver: bool = True) -> None:
        """The handlers in place before :meth:`hold` again; with ``deliver``, the first
        waiting signal handed to its handler."""
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if deliver and self.waiting and previous:
            _deliver(previous[self.waiting[0]], self.waiting[0], None)


_Handler = Callable[[int, FrameType | None], Any] | int | None


def _deliver(handler: _Handler, signum: int, frame: FrameType | None) -> None:
    """What ``handler`` would have done with ``signum``: call it, ignore it, or (the default
    action) raise it again with the default handler in place."""
    if callable(handler):
        handler(signum, frame)
    elif handler == signal.SIG_DFL:
        signal.signal(signum, signal.SIG_DFL)
        signal.raise_signal(signum)


_BLOCKS: list[HeldSignals] = []  # the blocks open now, outermost first


@contextmanager
def held_signals(deliver: bool = True) -> Iterator[HeldSignals]:
    """A :class:`HeldSignals` whose signals, once held, are handed over when the block ends
    (one that ends by an exception stops the command anyway: they are dropped). Inside
    another such block, the outer block's: its end, not this one's, hands them over. With
    ``deliver`` false they are dropped at the end too: the block is the whole command, so
    what was asked to stop has ended (``simulate`` prints its table and exits 0)."""
    if _BLOCKS:
        yield _BLOCKS[-1]
        return
    held = HeldSignals()
    _BLOCKS.append(held)
    try:
        yield held
    except BaseException:
        held.release(deliver=False)
        raise
    finally:
        _BLOCKS.remove(held)
    held.release(deliver)
