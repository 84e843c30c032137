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
from collections.abc import Callable

__all__ = [
    "RUNTIME_ENV",
    "configure_logging",
    "configure_process",
    "require_device",
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


def wait_for_stop(on_stop: Callable[[], None]) -> int:
    """Block until SIGTERM or SIGINT, then run ``on_stop``; return exit status 0."""
    stop = threading.Event()
    for number in (signal.SIGTERM, signal.SIGINT):
        signal.signal(number, lambda *_: stop.set())
    while not stop.wait(0.5):
        pass
    on_stop()
    return 0
