"""``edgesplit simulate --broker embedded`` with hundreds of clients in a process that may open
256 files: the clients share a few broker connections (``wire.shared``), so the count of
sockets and threads does not grow with the clients."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cli import ROOT

pytestmark = pytest.mark.e2e

_LIMITED = (
    "import resource, sys\n"
    "resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))\n"
    "from edgesplit.cli import main\n"
    "raise SystemExit(main(sys.argv[1:]))\n"
)


def test_hundreds_of_clients_over_an_embedded_broker_under_a_low_file_limit(
    tmp_path: Path,
) -> None:
    pytest.importorskip("sklearn")
    config, out = tmp_path / "sim.yaml", tmp_path / "sim"
    # a connection per transport (two per client, three files each) would need 1,200 files
    config.write_text("clients: 200\nrounds: 1\nworkers: 2\nmeasure_memory: false\n")
    args = ["simulate", "--config", str(config), "--out", str(out), "--broker", "embedded", "-q"]
    done = subprocess.run(
        [sys.executable, "-c", _LIMITED, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert [r["participants"] for r in summary["rounds"]] == [200]
    assert sum(c["examples"] for c in summary["clients"]) > 0
    assert all(c["rounds_trained"] == 1 for c in summary["clients"])
