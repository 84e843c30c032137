"""What the long-running role commands share: logging, transports, and a clean stop."""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Callable

__all__ = ["configure_logging", "wait_for_stop"]


def configure_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    for noisy in ("flwr", "paho", "alembic"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def wait_for_stop(on_stop: Callable[[], None]) -> int:
    """Block until SIGTERM or SIGINT, then run ``on_stop``; return exit status 0."""
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    on_stop()
    return 0
