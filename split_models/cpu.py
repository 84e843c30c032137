"""How much CPU this process may use: its cgroup's CPU quota (a container's ``--cpus``, a
systemd unit's ``CPUQuota``) and the CPUs it may run on.

A process under a quota runs at full speed until the period's quota is spent, then waits for
the next period. Steps timed while it waits on something else (its link) measure the full
speed; steps that keep it busy measure the quota. The share returned here lets the coordinator
tell the two apart (``coordinator.speed``). Without torch: the role agents read it at start.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Iterator
from pathlib import Path

__all__ = [
    "MIN_SHARE",
    "cpu_limited",
    "cpu_limits_unavailable",
    "cpu_quota_cores",
    "cpu_share",
    "process_cpu_share",
]

_ROOT = Path("/sys/fs/cgroup")
MIN_SHARE = 1e-3  # the smallest share reported (and accepted by the coordinator)


def _own_paths(text: str) -> tuple[str | None, str | None]:
    """This process's cgroup paths from ``/proc/self/cgroup``: the v2 one and the v1 ``cpu``
    controller's (None: not listed)."""
    unified = v1 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            unified = parts[2]
        elif "cpu" in parts[1].split(","):
            v1 = parts[2]
    return unified, v1


def _ancestors(base: Path, path: str) -> list[Path]:
    """``base/path`` and every folder above it up to ``base`` (a quota on a parent binds too;
    inside a container the listed path may not exist, its cgroup being mounted at ``base``)."""
    folder = base / path.strip("/")
    found = [folder, *folder.parents]
    return [f for f in found if f == base or base in f.parents]


def _quota_v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else _cores(int(quota), int(period))
    except (OSError, ValueError):
        return None


def _quota_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return _cores(quota, period)


def _cores(quota: int, period: int) -> float | None:
    """A quota in cores; None for none (-1) or nonsense (a period of 0)."""
    return quota / period if quota > 0 and period > 0 else None


def cpu_quota_cores(root: Path = _ROOT, own: str | None = None) -> float | None:
    """The tightest CPU quota over this process's cgroup and its parents, in cores (0.5: half
    a core), or None when there is none or it cannot be read. ``own``: the text of
    ``/proc/self/cgroup`` (read when None)."""
    if own is None:
        try:
            own = Path("/proc/self/cgroup").read_text()
        except OSError:
            return None
    unified, v1 = _own_paths(own)
    quotas: list[float] = []
    if unified is not None:
        quotas += [q for f in _ancestors(root, unified) if (q := _quota_v2(f)) is not None]
    if v1 is not None:
        for mount in (root / "cpu", root / "cpu,cpuacct"):
            quotas += [q for f in _ancestors(mount, v1) if (q := _quota_v1(f)) is not None]
    return min(quotas) if quotas else None


def cpu_share(threads: int, quota: float | None = None) -> float:
    """The share of ``threads`` busy threads' demand that the CPUs and quota allow, in
    (0, 1]: 0.25 for one thread under a quarter-core quota, 1 without a quota."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    cores = min(float(cpus), math.inf if quota is None else quota)
    return max(min(1.0, cores / max(threads, 1)), MIN_SHARE)


@functools.cache
def process_cpu_share(threads: int) -> float:
    """:func:`cpu_share` of this process's own quota, read once a process (a host of many
    simulated clients builds many trainers; a quota changed while it runs, ``docker update
    --cpus``, is seen after a restart)."""
    return cpu_share(threads, cpu_quota_cores())


# ---------------------------------------------------------------- emulating slower devices

_V1_CPU = _ROOT / "cpu"


def cpu_limits_unavailable() -> str | None:
    """None when :func:`cpu_limited` works here (root, cgroup v1's ``cpu`` controller), else
    why not."""
    if os.geteuid() != 0:
        return "needs root to create cgroups"
    if not os.access(_V1_CPU / "cpu.cfs_quota_us", os.W_OK):
        return f"no writable cgroup v1 cpu controller at {_V1_CPU}"
    return None


@contextlib.contextmanager
def cpu_limited(name: str, cores: float) -> Iterator[Path]:
    """A cgroup v1 group holding its processes to ``cores`` CPUs, removed afterwards (the
    benchmarks' slow devices). Start a process in it with
    ``sh -c 'echo $$ > GROUP/cgroup.procs && exec "$@"' sh COMMAND...``."""
    group = _V1_CPU / f"edgesplit-{name}"
    group.mkdir(exist_ok=True)
    period = int((group / "cpu.cfs_period_us").read_text())
    (group / "cpu.cfs_quota_us").write_text(str(int(cores * period)))
    try:
        yield group
    finally:
        for _ in range(50):  # its processes may take a moment to leave
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.1)
