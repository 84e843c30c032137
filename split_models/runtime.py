"""Process settings every edgesplit process applies once, before torch is imported, and what
the long-running role commands share (logging, a clean stop).

- ``OMP_WAIT_POLICY=PASSIVE`` and one intra-op thread: on small machines OpenMP spin-waits make
  two busy training processes several times slower.
- ``MKL_DISABLE_FAST_MM=1``: MKL frees its GEMM buffers after each call instead of keeping a
  process-wide pool, so a training process holds what its plan budgeted (and the memory
  profiler can measure each block's working set).
- ``FLWR_TELEMETRY_ENABLED=0``: no telemetry from Flower.

Values already set in the environment are kept: a user can override any of them.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

__all__ = [
    "RUNTIME_ENV",
    "configure_logging",
    "configure_process",
    "require_device",
    "serve",
    "wait_for_stop",
]

RUNTIME_ENV = {
    "OMP_WAIT_POLICY": "PASSIVE",
    "OMP_NUM_THREADS": "1",
    "MKL_DISABLE_FAST_MM": "1",
    "FLWR_TELEMETRY_ENABLED": "0",
}


def configure_process(threads: int = 1, torch_too: bool = True) -> None:
    """Apply :data:`RUNTIME_ENV` (without overriding) and limit torch to ``threads`` threads.
    ``torch_too=False``: for a command that never trains (reading a store), which then need
    not wait 1-2 s for torch to load; torch loaded later still finds the environment."""
    for key, value in RUNTIME_ENV.items():
        os.environ.setdefault(key, value)
    if not torch_too:
        return
    import torch

    torch.set_num_threads(threads)


def require_device(device: str, key: str) -> None:
    """Fail with a clear error, naming the setting ``key``, when torch cannot train on
    ``device`` (cpu, cuda, cuda:N or mps) in this process."""
    import torch

    from split_models.errors import ConfigError

    kind, colon, index = device.partition(":")
    if kind not in ("cpu", "cuda", "mps") or (colon and not (kind == "cuda" and index.isdigit())):
        raise ConfigError(f"{key}: {device!r} is not a device; use cpu, cuda, cuda:N or mps")
    if kind == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count <= int(index or 0):
            seen = f"{count} CUDA device(s)" if count else "no CUDA device"
            raise ConfigError(f"{key}: {device}, but torch sees {seen} in this process")
    elif kind == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"{key}: mps, but torch has no MPS device in this process")


def configure_logging(verbose: bool = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format="%(asctime)s %(name)s %(levelname)s: %(message)s",
    )
    # third-party libraries' own debugging (matplotlib's font search wrote hundreds of lines
    # under --verbose) is not what --verbose asks for
    for noisy in ("flwr", "paho", "alembic", "matplotlib", "PIL", "onnxscript", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def wait_for_stop(on_stop: Callable[[], None], what: str = "the role") -> int:
    """Block until SIGTERM, SIGINT or SIGHUP, then run ``on_stop``; return exit status 0.
    The stop is said when it begins and when it is done: it takes seconds (the last
    messages acknowledged, a step under way finished), silent before."""
    stop = threading.Event()
    for name in ("SIGTERM", "SIGINT", "SIGHUP"):
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    said = logging.getLogger("edgesplit")
    began = time.monotonic()
    said.info("%s stopping: saying it is offline, waiting for its last messages to go", what)
    on_stop()
    said.info("%s stopped (%.1f s)", what, time.monotonic() - began)
    return 0


def serve(start: Callable[[list[Any]], Callable[[], None]], what: str) -> int:
    """A long-running role (``what``: "edge pi-01"), started by ``start`` and run until it
    is stopped: exit status 0. ``start`` appends what it opens (anything with ``close()``) to
    the list it is given and returns the role's stop. A stop that comes while it starts (a
    broker still unreachable, the speed being measured) closes what it opened and is a stop
    as well: it exited 143 "interrupted" before, where a stop after start-up exits 0."""
    opened: list[Any] = []
    try:
        return wait_for_stop(start(opened), what)
    except KeyboardInterrupt:  # the first signal, as the command's handler raises it
        for item in reversed(opened):
            item.close()
        logging.getLogger("edgesplit").info("%s stopped before it came online", what)
        return 0
