"""A process in a real cgroup with a CPU quota reads the quota, and the share its training
clock reports follows it (needs root and cgroup v1's ``cpu`` controller; skipped elsewhere)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.cli import ROOT

pytestmark = pytest.mark.integration

CGROUP = Path("/sys/fs/cgroup/cpu")
PROBE = (
    "import json; from split_models.cpu import cpu_quota_cores, process_cpu_share; "
    "print(json.dumps([cpu_quota_cores(), process_cpu_share(1), process_cpu_share(2)]))"
)


def test_a_process_under_a_quarter_core_quota_reports_a_quarter_share() -> None:
    if os.geteuid() != 0 or not os.access(CGROUP / "cpu.cfs_quota_us", os.W_OK):
        pytest.skip("needs root and a writable cgroup v1 cpu controller")
    group = CGROUP / f"edgesplit-test-{os.getpid()}"
    group.mkdir()
    try:
        period = int((group / "cpu.cfs_period_us").read_text())
        (group / "cpu.cfs_quota_us").write_text(str(period // 4))
        join = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        done = subprocess.run(
            ["sh", "-c", join, "sh", sys.executable, "-c", PROBE],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    finally:
        for _ in range(50):
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.1)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [0.25, 0.25, 0.125]
