"""Warnings about hostile or broken input, rate-limited: a flood of bad messages from one
device must not flood the log (or fill a disk) as well.

``warn(log, key, message, *args)`` logs at most :data:`BURST` warnings per ``key`` in a
:data:`WINDOW`-second window; when a window with suppressed ones ends, the next warning for
the key says how many were left out.
"""

from __future__ import annotations

import logging
import threading
import time
import unicodedata
from collections.abc import Callable, Hashable

__all__ = ["BURST", "WINDOW", "WarningLimiter", "printable", "reset_warnings", "warn"]

BURST = 5
WINDOW = 60.0
_MAX_KEYS = 4096


class WarningLimiter:
    """Per-key counts of warnings in the current window."""

    def __init__(
        self,
        burst: int = BURST,
        window: float = WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst, self.window, self._clock = burst, window, clock
        self._windows: dict[Hashable, tuple[float, int]] = {}  # key -> (start, count)
        self._lock = threading.Lock()

    def admit(self, key: Hashable) -> tuple[bool, int]:
        """Whether a warning for ``key`` may be logged now, and how many of its warnings the
        window before left out (to say so once)."""
        now = self._clock()
        with self._lock:
            start, count = self._windows.get(key, (now, 0))
            suppressed = 0
            if now - start >= self.window:
                suppressed = max(0, count - self.burst)
                start, count = now, 0
            if len(self._windows) >= _MAX_KEYS and key not in self._windows:
                self._windows.clear()  # bounded: forgetting counts only lets a few more through
            self._windows[key] = (start, count + 1)
            return count < self.burst, suppressed

    def reset(self) -> None:
        """Forget every key's window (each test starts with a fresh allowance)."""
        with self._lock:
            self._windows.clear()


_LIMITER = WarningLimiter()


def warn(
    log: logging.Logger, key: Hashable, message: str, *args: object, level: int = logging.WARNING
) -> None:
    """``log.warning(message, *args)`` (or at ``level``), at most :data:`BURST` times a
    window for ``key``."""
    allowed, suppressed = _LIMITER.admit((log.name, key))
    if allowed:
        if suppressed:
            message += f" ({suppressed} more like it left out of the log)"
        log.log(level, message, *args)


def reset_warnings() -> None:
    """Let every key warn again at once, as in a fresh process."""
    _LIMITER.reset()


def printable(text: object, limit: int = 500) -> str:
    """``text`` from a device, safe to log and print: control and format characters (a
    newline that forges a log line, a terminal's escape sequences, a right-to-left
    override) written as escapes (``\\n``, ``\\x1b``), at most ``limit`` characters."""
    value = str(text)[:limit]
    if value.isprintable():
        return value
    return "".join(
        c if c.isprintable() or unicodedata.category(c) == "Zs" else ascii(c)[1:-1] for c in value
    )
