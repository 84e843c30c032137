"""``edgesplit db upgrade`` and ``edgesplit status`` against real databases."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from storage import DeviceResult, open_store
from tests.e2e.cli import run_cli as run

pytestmark = pytest.mark.e2e


def _populate(url: str, checkpoints: Path) -> None:
    with open_store(url, checkpoints) as store:
        store.create_run("demo-1", {"rounds": 2}, seed=3)
        store.open_round("demo-1", 1, ["pi-01", "pi-02"])
        store.record_result(
            "demo-1", 1, DeviceResult("pi-01", examples=64, bytes_sent=4096, bytes_received=512)
        )
        store.record_result(
            "demo-1", 1, DeviceResult("pi-02", examples=32, bytes_sent=1024, bytes_received=256)
        )
        store.commit_round(
            "demo-1",
            1,
            {"edge": {"w": np.zeros(4, dtype=np.float32)}},
            evaluation={"accuracy": 0.75, "loss": 0.9},
        )
        store.set_run_status("demo-1", "finished")
        edges = [{"name": "pi-01", "blocks": [0, 2]}, {"name": "pi-02", "blocks": [0, 5]}]
        servers = [{"name": "gpu-a", "blocks": [2, 6]}]
        store.set_plan("demo-1", {"edges": edges, "servers": servers, "cuts": "per-device"})


@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_upgrade_then_status(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> None:
    url = (
        str(tmp_path / "runs.db")
        if backend == "sqlite"
        else request.getfixturevalue("postgres_url")
    )
    upgraded = run("db", "upgrade", "--db", url)
    assert upgraded.returncode == 0, upgraded.stderr
    _populate(url, tmp_path / "runs.db.checkpoints")
    listing = run("status", "--db", url)
    assert listing.returncode == 0 and "demo-1" in listing.stdout and "finished" in listing.stdout
    detail = run("status", "--db", url, "--run", "demo-1", "--json")
    assert detail.returncode == 0, detail.stderr
    status = json.loads(detail.stdout)
    assert status["run_id"] == "demo-1" and status["status"] == "finished"
    (first,) = status["rounds"]
    assert first["round"] == 1 and first["state"] == "committed"
    assert first["accuracy"] == 0.75 and first["loss"] == 0.9
    assert first["participants"] == ["pi-01", "pi-02"]
    assert first["bytes_up"] == 5120 and first["bytes_down"] == 768
    table = run("status", "--db", url, "--run", "demo-1")
    assert "committed" in table.stdout and "0.7500" in table.stdout
    plan = "cuts {'pi-01': 2, 'pi-02': 5} (per-device); GPU servers gpu-a [2, 6)"
    assert plan in table.stdout.splitlines(), table.stdout


def test_status_errors_exit_2(tmp_path: Path) -> None:
    missing = run("status", "--db", str(tmp_path / "nope.db"))
    assert missing.returncode == 2 and "no database" in missing.stderr
    database = tmp_path / "runs.db"
    assert run("db", "upgrade", "--db", str(database)).returncode == 0
    unknown = run("status", "--db", str(database), "--run", "ghost")
    assert unknown.returncode == 2 and "ghost" in unknown.stderr


def test_store_commands_start_without_loading_torch(tmp_path: Path) -> None:
    # status, runs and db only read or change a store: loading torch made each take 2 s
    import subprocess
    import sys

    url = str(tmp_path / "runs.db")
    _populate(url, tmp_path / "runs.db.checkpoints")
    probe = (
        "import sys\n"
        "from edgesplit.cli import main\n"
        "for argv in sys.argv[1:]:\n"
        "    assert main(argv.split('|')) == 0, argv\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    commands = [f"status|--db|{url}", f"status|--db|{url}|--run|demo-1", f"db|upgrade|--db|{url}"]
    done = subprocess.run(
        [sys.executable, "-c", probe, *commands], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]", done.stdout[-2000:]
