"""Reading a process's CPU quota from its cgroup (v1 and v2), on fake cgroup trees."""

from __future__ import annotations

from pathlib import Path

import pytest

from split_models.cpu import cpu_quota_cores, cpu_share

pytestmark = pytest.mark.unit


def _write(folder: Path, **files: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name.replace("_", ".", 1)).write_text(text)


def test_a_v2_quota_on_the_process_or_a_parent_binds_the_tightest(tmp_path: Path) -> None:
    _write(tmp_path, cpu_max="max 100000\n")
    _write(tmp_path / "edge", cpu_max="150000 100000\n")
    _write(tmp_path / "edge" / "pi", cpu_max="max 100000\n")
    assert cpu_quota_cores(tmp_path, "0::/edge/pi\n") == 1.5
    _write(tmp_path / "edge" / "pi", cpu_max="25000 100000\n")
    assert cpu_quota_cores(tmp_path, "0::/edge/pi\n") == 0.25


def test_a_v1_quota_is_read_from_the_cpu_controller(tmp_path: Path) -> None:
    group = tmp_path / "cpu" / "bench"
    _write(tmp_path / "cpu", cpu_cfs_quota_us="-1\n", cpu_cfs_period_us="100000\n")
    _write(group, cpu_cfs_quota_us="50000\n", cpu_cfs_period_us="100000\n")
    own = "4:memory:/other\n1:cpu:/bench\n0::/\n"
    assert cpu_quota_cores(tmp_path, own) == 0.5
    combined = tmp_path / "cpu,cpuacct" / "bench"
    _write(combined, cpu_cfs_quota_us="20000\n", cpu_cfs_period_us="100000\n")
    assert cpu_quota_cores(tmp_path, "2:cpu,cpuacct:/bench\n") == 0.2


def test_no_quota_or_unreadable_files_or_a_container_path_mean_none(tmp_path: Path) -> None:
    assert cpu_quota_cores(tmp_path, "0::/\n") is None
    _write(tmp_path, cpu_max="garbage\n")
    assert cpu_quota_cores(tmp_path, "0::/\n") is None
    assert cpu_quota_cores(tmp_path, "not a cgroup line\n") is None
    # in a container the listed path is the host's; its own cgroup is mounted at the root
    _write(tmp_path, cpu_max="50000 100000\n")
    assert cpu_quota_cores(tmp_path, "0::/docker/abc123\n") == 0.5


def test_a_v1_container_reads_the_quota_at_its_mount_and_nonsense_is_none(tmp_path: Path) -> None:
    # the listed path is the host's; the container's own group is mounted at cpu/
    _write(tmp_path / "cpu", cpu_cfs_quota_us="75000\n", cpu_cfs_period_us="100000\n")
    assert cpu_quota_cores(tmp_path, "1:cpu:/kubepods/pod-1/abc\n") == 0.75
    _write(tmp_path / "cpu", cpu_cfs_quota_us="75000\n", cpu_cfs_period_us="0\n")
    assert cpu_quota_cores(tmp_path, "1:cpu:/\n") is None
    _write(tmp_path, cpu_max="abc 100000\n")
    assert cpu_quota_cores(tmp_path, "0::/\n") is None


def test_the_share_is_what_the_quota_allows_of_the_threads_demand() -> None:
    assert cpu_share(1, 0.25) == 0.25
    assert cpu_share(4, 1.0) == 0.25
    assert cpu_share(1, 2.0) == 1.0
    assert cpu_share(1, None) == 1.0
    assert cpu_share(1, 0.0) == 1e-3  # never 0: a share divides nothing, it scales
