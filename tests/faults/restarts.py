"""Killing and restarting a deployment's coordinator, and what each kill cost, read from the
store alone (opened read-only: no garbage collection that would hide an orphaned file).
Shared by ``tests/faults/test_coordinator_kill.py`` and ``benchmarks/faults_coordinator.py``."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from storage import RoundRecord, StoreError, open_store
from tests.e2e.deployment import Deployment

__all__ = [
    "RUN",
    "Kill",
    "checkpoint_folder",
    "kill_coordinator",
    "orphans",
    "restart",
    "rounds",
    "wait_for",
]

RUN = "e2e-1"


@dataclass
class Kill:
    """One SIGKILL of the coordinator: the rounds committed then, the round it had opened
    (trained again after the restart), and what the restart took."""

    committed: int
    opened: int | None
    at: datetime
    restart_seconds: float | None = None  # restart to the next round opening again
    reopened: int | None = None  # that round


def rounds(deployment: Deployment) -> list[RoundRecord]:
    """The run's rounds as the store holds them now (none before the run exists)."""
    try:
        with open_store(deployment.db, readonly=True) as store:
            return store.list_rounds(RUN)
    except StoreError:  # no run yet, or a store still being created
        return []


def kill_coordinator(deployment: Deployment) -> Kill:
    """SIGKILL the coordinator; what it left in the store."""
    deployment.kill("coordinator")
    at, found = datetime.now(UTC), rounds(deployment)
    committed = [r.number for r in found if r.state == "committed"]
    unfinished = [r.number for r in found if r.state != "committed"]
    return Kill(max(committed, default=0), min(unfinished, default=None), at)


def restart(deployment: Deployment, kill: Kill, limit: float = 600.0) -> None:
    """Start the coordinator again with the same command and wait until it opens a round (the
    one it redoes, or the next): ``kill.restart_seconds`` from the start to that moment."""
    started, moment = time.monotonic(), datetime.now(UTC)
    process = deployment.start_coordinator()
    while time.monotonic() - started < limit:
        fresh = [r for r in rounds(deployment) if r.opened_at and r.opened_at > moment]
        if fresh:
            first = fresh[0]
            kill.restart_seconds = (first.opened_at - moment).total_seconds()  # type: ignore[operator]
            kill.reopened = first.number
            return
        if process.poll() is not None:
            return  # finished (nothing left to train) or failed: the caller's wait says which
        time.sleep(0.05)
    log = deployment.log("coordinator")
    raise AssertionError(f"no round opened {limit:.0f} s after a restart\n{log}")


def wait_for(
    deployment: Deployment, condition: Callable[[list[RoundRecord]], bool], limit: float, what: str
) -> None:
    """Poll the store (read-only) until ``condition`` holds for the run's rounds."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if condition(rounds(deployment)):
            return
        if deployment.processes["coordinator"].poll() not in (None, 0):
            raise AssertionError(f"the coordinator exited: {deployment.log('coordinator')}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}\n{deployment.log('coordinator')}")


def checkpoint_folder(deployment: Deployment) -> Path:
    return Path(deployment.db.removeprefix("sqlite:///") + ".checkpoints")


def orphans(deployment: Deployment) -> list[str]:
    """Files in the checkpoint folder that no committed round refers to (``.tmp`` included)."""
    with open_store(deployment.db, readonly=True) as store:
        committed = [r.number for r in store.list_rounds(RUN) if r.state == "committed"]
        referenced = {
            f"{ref.sha256}.safetensors"
            for number in committed
            for ref in store.checkpoint(RUN, number).checkpoints
        }
    return sorted(
        p.name for p in checkpoint_folder(deployment).glob("??/*") if p.name not in referenced
    )
