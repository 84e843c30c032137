"""A process in a real cgroup with a CPU quota reads the quota, and the share its training
clock reports follows it (needs root and cgroup v1's ``cpu`` controller; skipped elsewhere)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from split_models.cpu import cpu_limited, cpu_limits_unavailable
from tests.e2e.cli import ROOT

pytestmark = pytest.mark.integration

PROBE = (
    "import json; from split_models.cpu import cpu_quota_cores, process_cpu_share; "
    "print(json.dumps([cpu_quota_cores(), process_cpu_share(1), process_cpu_share(2)]))"
)


def test_a_process_under_a_quarter_core_quota_reports_a_quarter_share() -> None:
    if (why := cpu_limits_unavailable()) is not None:
        pytest.skip(why)
    with cpu_limited(f"test-{os.getpid()}", 0.25) as group:
        join = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        done = subprocess.run(
            ["sh", "-c", join, "sh", sys.executable, "-c", PROBE],
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [0.25, 0.25, 0.125]
