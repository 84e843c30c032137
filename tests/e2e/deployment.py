"""A deployment of separate processes for end-to-end tests: a coordinator, one GPU server and
edges, each started with the ``edgesplit`` command as an operator would, on a real broker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from split_models.runtime import RUNTIME_ENV
from storage import NotFoundError, open_store
from storage.report import run_status
from tests.e2e.cli import ROOT, run_cli

SHARED = ROOT.parent / "shared" / "data" / "mnist8k.npz"
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_mnist.npz"
# Budgets that force three different split points of cnn at batch 32 with Adam and fp16
# activations: the edges' estimates are 15.2 MiB at cut 1, 18.4 MiB at cut 2, 19.7 MiB at
# cut 4 and 28 MiB at cut 5 (the GPU server is declared slow, so each edge takes the deepest
# prefix that fits).
EDGES = {"pi-01": "16MiB", "pi-02": "19MiB", "pi-03": "24MiB"}


def split_data(directory: Path, per_edge: int = 800, test: int = 1000) -> tuple[list[Path], Path]:
    """Each edge's training file and the held-out test file, from mnist8k when present."""
    source = SHARED if SHARED.exists() else FIXTURE
    with np.load(source) as archive:
        x, y = archive["x"], archive["y"]
    per_edge = min(per_edge, (len(x) * 3 // 4) // len(EDGES))
    test = min(test, len(x) - per_edge * len(EDGES))
    files = []
    for index in range(len(EDGES)):
        rows = np.arange(index, per_edge * len(EDGES), len(EDGES))
        files.append(directory / f"edge{index}.npz")
        np.savez(files[-1], x=x[rows], y=y[rows])
    held_out = directory / "test.npz"
    np.savez(held_out, x=x[-test:], y=y[-test:])
    return files, held_out


@dataclass
class Deployment:
    broker_url: str
    db: str
    directory: Path
    rounds: int = 3
    deadline: str = "60s"
    local_epochs: int = 1
    # the GPU server trains the edges' batches in name order: two runs of one seed compare
    deterministic: bool = False
    per_edge: int = 800  # training examples per edge (fewer: shorter rounds)
    max_attempts: int | None = None  # the coordinator's --max-attempts (None: its default)
    processes: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    # A broker with accounts: the URL each account connects with (no password inside) and the
    # environment that gives it its password (EDGESPLIT_BROKER_PASSWORD_FILE).
    url_for: Callable[[str], str] | None = None
    env_for: Callable[[str], dict[str, str]] | None = None
    training: dict[str, Any] = field(default_factory=dict)  # keys that replace the run's
    budgets: dict[str, str] = field(default_factory=lambda: dict(EDGES))  # each edge's --memory

    def __post_init__(self) -> None:
        self.data, self.test_data = split_data(self.directory, self.per_edge)
        self.config = self.directory / "run.yaml"
        self.config.write_text(
            yaml.safe_dump(
                {
                    "run_id": "e2e-1",
                    "model": "cnn",
                    "input_shape": [1, 28, 28],
                    "num_classes": 10,
                    "eval_data": f"npz:{self.test_data}",
                    "devices": {"edges": list(EDGES), "gpu_servers": 1, "wait": "120s"},
                    "rounds": self.rounds,
                    "batch_size": 32,
                    "local_epochs": self.local_epochs,
                    "optimizer": {"name": "adam", "lr": 0.001},
                    "compression": "fp16",
                    "round_deadline": self.deadline,
                    "seed": 0,
                    "deterministic": self.deterministic,
                }
                | self.training
            )
        )

    def broker_for(self, account: str) -> str:
        """The broker URL ``account`` (a device name, ``gpu`` or ``coordinator``) uses."""
        return self.url_for(account) if self.url_for else self.broker_url

    def _start(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        # run in the test's directory: a PostgreSQL store's checkpoints go to ./checkpoints
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, **RUNTIME_ENV, "MALLOC_MMAP_THRESHOLD_": "65536", "PYTHONPATH": path}
        if self.env_for is not None:
            env.update(self.env_for(_account(name)))
        log = (self.directory / f"{name}.log").open("ab")
        process = subprocess.Popen(
            [sys.executable, "-m", "edgesplit", *args],
            cwd=self.directory,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.processes[name] = process
        return process

    def start_gpu(self) -> None:
        self._start(
            "gpu-a",
            "gpu-server",
            "--id",
            "gpu-a",
            "--broker",
            self.broker_for("gpu"),
            "--flops",
            "1e9",
        )

    def start_edge(self, name: str) -> None:
        index = list(EDGES).index(name)
        self._start(
            name,
            "edge",
            "--id",
            name,
            "--broker",
            self.broker_for(name),
            "--data",
            f"npz:{self.data[index]}",
            "--memory",
            self.budgets[name],
            "--flops",
            "1e12",
        )

    def start_coordinator(self, name: str = "coordinator", *extra: str) -> subprocess.Popen[bytes]:
        # a server database is told once where its checkpoints go (it records the folder)
        where = () if self.db.startswith("sqlite") else ("--checkpoints", "checkpoints")
        if self.max_attempts is not None:
            where = (*where, "--max-attempts", str(self.max_attempts))
        return self._start(
            name,
            "coordinator",
            "--config",
            str(self.config),
            "--db",
            self.db,
            "--broker",
            self.broker_for("coordinator"),
            *where,
            *extra,
        )

    def start_all(self) -> subprocess.Popen[bytes]:
        self.start_gpu()
        for name in EDGES:
            self.start_edge(name)
        return self.start_coordinator()

    def kill(self, name: str) -> None:
        process = self.processes[name]
        process.send_signal(signal.SIGKILL)
        process.wait(30)

    def status(self) -> dict[str, Any]:
        done = run_cli("status", "--db", self.db, "--run", "e2e-1", "--json", timeout=60)
        if done.returncode != 0:
            return {"status": "absent", "rounds": [], "error": done.stderr}
        return json.loads(done.stdout)  # type: ignore[no-any-return]

    def wait_until(
        self, condition: Callable[[dict[str, Any]], bool], timeout: float, what: str
    ) -> dict[str, Any]:
        """Poll the store directly (every 50 ms: fast enough to act inside one round)."""
        deadline = time.monotonic() + timeout
        status: dict[str, Any] = {}
        with open_store(self.db) as store:
            while time.monotonic() < deadline:
                try:
                    status = run_status(store, "e2e-1")
                except NotFoundError:
                    status = {"status": "absent", "rounds": []}
                if condition(status):
                    return status
                coordinator = self.processes.get("coordinator")
                if coordinator is not None and coordinator.poll() not in (None, 0):
                    raise AssertionError(f"the coordinator exited: {self.log('coordinator')}")
                time.sleep(0.05)
        raise AssertionError(
            f"timed out waiting for {what}; last status {status}\n{self.log('coordinator')}"
        )

    def log(self, name: str) -> str:
        path = self.directory / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def stop(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(5)


def _account(process: str) -> str:
    """The broker account of a deployment's process: GPU servers share ``gpu``."""
    return "gpu" if process.startswith("gpu") else process


def committed(status: dict[str, Any], number: int) -> bool:
    return any(r["round"] == number and r["state"] == "committed" for r in status["rounds"])


def opened(status: dict[str, Any], number: int) -> bool:
    return any(r["round"] == number and r["state"] == "open" for r in status["rounds"])
