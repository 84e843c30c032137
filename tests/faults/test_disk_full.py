"""The checkpoint disk fills up under a real coordinator (issue 17): the coordinator stops with
one line (exit 1, no traceback), leaves no partial file, and the same command resumes once
space is back and finishes the run.

Where this process may mount (root, Linux), the checkpoint folder is a small tmpfs filled to
the last byte: the write fails with the kernel's own ENOSPC. Elsewhere (unprivileged CI) the
coordinator is started with a ``sitecustomize`` that makes ``os.fsync`` of a checkpoint's
temporary file raise ENOSPC while a flag file exists: an injected error, named in the test id.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cli import ROOT
from tests.faults.conftest import Fleet
from tests.faults.disk import INJECT, can_mount, full_disk, partial_files
from tests.faults.watch import ROUND_TIMEOUT, START_TIMEOUT, status_of

pytestmark = pytest.mark.e2e

MODE = "tmpfs" if can_mount() else "injected-oserror"


@pytest.mark.parametrize("mode", [MODE])
def test_a_full_checkpoint_disk_stops_the_coordinator_and_the_run_resumes(
    fleet: Fleet, mode: str, tmp_path: Path
) -> None:
    inject, flag = tmp_path / "inject", tmp_path / "disk-is-full"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(INJECT)
    environment = {
        "PYTHONPATH": os.pathsep.join([str(inject), str(ROOT)]),
        "EDGESPLIT_TEST_DISK_FULL_FLAG": str(flag),
    }
    deployment, _ = fleet(
        rounds=2,
        per_edge=64,
        deadline="30s",
        env_for=lambda account: environment if account == "coordinator" else {},
    )
    folder = Path(f"{deployment.directory / 'runs.db'}.checkpoints")  # SQLite's default
    with full_disk(mode, folder, flag) as free_space:
        coordinator = deployment.start_all()
        assert coordinator.wait(START_TIMEOUT + ROUND_TIMEOUT) == 1, deployment.log("coordinator")
        log = deployment.log("coordinator")
        assert "Traceback" not in log, log
        last = log.strip().splitlines()[-1]
        assert last.startswith("edgesplit coordinator: error: no space left on device"), last
        assert "run the same command again" in last, last
        assert partial_files(folder) == []
        assert all(r["state"] != "committed" for r in status_of(deployment)["rounds"])

        free_space()
        resumed = deployment.start_coordinator()
        assert resumed.wait(START_TIMEOUT + 2 * ROUND_TIMEOUT) == 0, deployment.log("coordinator")

        status = status_of(deployment)
        assert status["status"] == "finished", status
        assert [r["state"] for r in status["rounds"]] == ["committed"] * 2
        assert partial_files(folder) == []


def test_the_injection_fails_fsync_with_enospc_while_flagged(tmp_path: Path) -> None:
    """The fallback's injection itself: ENOSPC on a ``.tmp`` file's fsync while the flag
    exists, nothing otherwise (so the run above really resumes once 'space is back')."""
    (tmp_path / "sitecustomize.py").write_text(INJECT)
    flag, probe = tmp_path / "flag", tmp_path / "x.tmp"
    flag.touch()
    code = (
        "import os\n"
        f"fd = os.open({str(probe)!r}, os.O_WRONLY | os.O_CREAT)\n"
        "try:\n    os.fsync(fd)\nexcept OSError as e:\n    print(e.errno)\n"
        f"os.remove({str(flag)!r})\nos.fsync(fd)\nprint('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "EDGESPLIT_TEST_DISK_FULL_FLAG": str(flag)}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.stdout.split() == [str(errno.ENOSPC), "ok"], done.stderr
