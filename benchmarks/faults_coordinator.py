"""Faults (issue 17): the coordinator SIGKILLed at random points across a run, started again
at once with the same command each time.

The deployment of the end-to-end tests (``tests/e2e/deployment.py``: a private mosquitto,
SQLite, the coordinator, one GPU server and three edges, each its own ``edgesplit`` process;
``cnn``, 160 examples per edge, batch 32, 20 rounds). Once the run's second round commits, each
kill comes a random time (uniform, up to one restart and 1.2 rounds) after the last restart,
so kills land in restarts, mid-round and around commits alike; after 20 kills the run
finishes. Per kill: the round it had open (trained again: "redone"; a committed round trained
again would be "lost"), and the restart's cost beyond that round: from the restart to the
redone (or next) round opening, less the gap between a commit and the next round's opening
of an uninterrupted run. After each run: files in the checkpoint folder that no committed
round refers to (``.tmp`` included), read without garbage collection.

    python benchmarks/faults_coordinator.py [--quick]     (--quick: 8 rounds, 5 kills)

``benchmarks/faults.py`` joins its rows (``rows(quick)``).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the deployment harness lives in tests/

from storage import open_store  # noqa: E402
from tests.e2e.deployment import Deployment  # noqa: E402
from tests.faults.restarts import (  # noqa: E402
    RUN,
    Kill,
    kill_coordinator,
    orphans,
    rounds,
    wait_for,
)
from wire.broker import Broker  # noqa: E402

Row = tuple[str, str, str]


@dataclass
class Trial:
    """One run: its kills, whether it finished, the normal gap and what was left behind."""

    kills: list[Kill] = field(default_factory=list)
    finished: bool = False
    gap: float = 0.0  # commit -> next round open, uninterrupted (median)
    profiles: int = 0  # times the model was profiled (1: no restart profiled again)
    left: list[str] = field(default_factory=list)
    lost: int = 0  # committed rounds trained again (resumed before a round it had committed)
    startup: list[float] = field(
        default_factory=list
    )  # kill -> the restart resumed (process start)


def _restart_and_kill(fleet: Deployment, kill: Kill, delay: float) -> bool:
    """Start the coordinator again; kill it after ``delay`` s unless the run finishes first
    (False). ``kill`` gets the restart's time to its first round opening, when it got there."""
    moment, started = datetime.now(UTC), time.monotonic()
    process = fleet.start_coordinator()
    while time.monotonic() - started < delay:
        if process.poll() is not None:
            return False
        if kill.restart_seconds is None:
            fresh = [r for r in rounds(fleet) if r.opened_at and r.opened_at > moment]
            if fresh:
                kill.restart_seconds = (fresh[0].opened_at - moment).total_seconds()
                kill.reopened = fresh[0].number
        time.sleep(0.05)
    return True


def _gaps(fleet: Deployment, kills: list[Kill]) -> list[float]:
    """Commit -> next open of consecutive rounds no kill fell between."""
    found = {r.number: r for r in rounds(fleet)}
    gaps = []
    for number in range(1, max(found, default=0)):
        done, then = found.get(number), found.get(number + 1)
        if not (done and then and done.committed_at and then.opened_at):
            continue
        if any(done.committed_at <= k.at <= then.opened_at for k in kills):
            continue
        gaps.append((then.opened_at - done.committed_at).total_seconds())
    return gaps


def run_trial(
    broker: Broker, directory: Path, kills: int, rng: random.Random, rounds_: int
) -> Trial:
    """A run of ``rounds_`` rounds whose coordinator is killed ``kills`` times (fewer when
    the run finishes first)."""
    directory.mkdir(parents=True)
    db = f"sqlite:///{directory / 'runs.db'}"
    fleet = Deployment(broker.url, db, directory, rounds=rounds_, per_edge=160)
    trial = Trial()
    try:
        fleet.start_all()
        # kills begin after round 2: the first round of a fresh fleet is slow (cold processes)
        wait_for(
            fleet,
            lambda r: any(x.number == 1 and x.state == "committed" for x in r),
            1800,
            "round 1",
        )
        first = time.monotonic()
        wait_for(
            fleet,
            lambda r: any(x.number == 2 and x.state == "committed" for x in r),
            900,
            "round 2",
        )
        round_time = time.monotonic() - first
        restart_time = round_time  # until the first restart says better
        time.sleep(rng.uniform(0, 1.2 * round_time))
        for _ in range(kills):
            trial.kills.append(kill_coordinator(fleet))
            delay = rng.uniform(0, restart_time + 1.2 * round_time)
            if not _restart_and_kill(fleet, trial.kills[-1], delay):
                break
            if trial.kills[-1].restart_seconds is not None:
                restart_time = trial.kills[-1].restart_seconds
        trial.finished = fleet.processes["coordinator"].wait(900) == 0
    finally:
        fleet.stop()
    return _judged(fleet, trial)


def _judged(fleet: Deployment, trial: Trial) -> Trial:
    """What the finished run's store, log and checkpoint folder say about its kills."""
    with open_store(fleet.db, readonly=True) as store:
        resumed = [e for e in store.events(RUN) if e.kind == "resumed"]
        trial.finished = trial.finished and store.get_run(RUN).status == "finished"
    ends = [k.at for k in trial.kills[1:]] + [datetime.max.replace(tzinfo=UTC)]
    for kill, end in zip(trial.kills, ends, strict=True):
        # the restart after the kill, if it got as far as recording that it resumed
        event = next((e for e in resumed if e.at and kill.at < e.at < end), None)
        if event is None or event.at is None:
            continue
        trial.startup.append((event.at - kill.at).total_seconds())
        if not event.detail.startswith(f"after round {kill.committed} "):
            trial.lost += 1
    trial.gap = statistics.median(_gaps(fleet, trial.kills) or [0.0])
    trial.profiles = (fleet.directory / "coordinator.log").read_text().count("profiling cnn")
    trial.left = orphans(fleet)
    return trial


def measure(quick: bool) -> list[Trial]:
    """One run of 20 rounds and 20 kills (``quick``: 8 rounds, 5 kills)."""
    kills, rounds_ = (5, 8) if quick else (20, 20)
    with Broker() as broker, tempfile.TemporaryDirectory() as scratch:
        return [run_trial(broker, Path(scratch) / "run", kills, random.Random(17), rounds_)]


def rows(quick: bool) -> list[Row]:
    """The shared table's rows (``benchmarks/faults.py``): (fault, trials, outcome)."""
    return [_row(measure(quick))]


def _added(trials: list[Trial]) -> list[float]:
    """Per restart that reached a round: its time to that round beyond the normal gap."""
    return [
        k.restart_seconds - t.gap for t in trials for k in t.kills if k.restart_seconds is not None
    ]


def _row(trials: list[Trial]) -> Row:
    kills = [k for t in trials for k in t.kills]
    added = _added(trials)
    spread = (
        f"median {statistics.median(added):.1f} s, max {max(added):.1f} s "
        f"({len(added)} restarts reached a round)"
        if added
        else "no restart reached a round"
    )
    outcome = (
        f"{sum(t.finished for t in trials)}/{len(trials)} runs finished; "
        f"{sum(t.lost for t in trials)} committed rounds lost; "
        f"{sum(k.opened is not None for k in kills)} rounds redone, at most 1 per kill; "
        f"added per kill beyond the redone round: {spread}; "
        f"profiled {sum(t.profiles for t in trials)} times in {len(trials)} runs; "
        f"{sum(len(t.left) for t in trials)} orphaned files"
    )
    return ("coordinator SIGKILLed at random points, restarted at once", str(len(kills)), outcome)


def table(trials: list[Trial]) -> list[str]:
    """One line per run and one for all."""
    lines = [
        "| run | kills | finished | rounds redone | max redone per kill | committed rounds lost "
        "| s added per kill beyond the redone round (median / max) | of which process start "
        "(median) | profiled | orphaned files |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, group in [*((str(i + 1), [t]) for i, t in enumerate(trials)), ("all", trials)]:
        kills = [k for t in group for k in t.kills]
        added = _added(group)
        seconds = f"{statistics.median(added):.1f} / {max(added):.1f}" if added else "-"
        lines.append(
            f"| {name} | {len(kills)} | {sum(t.finished for t in group)}/{len(group)} "
            f"| {sum(k.opened is not None for k in kills)} "
            f"| {max((int(k.opened is not None) for k in kills), default=0)} "
            f"| {sum(t.lost for t in group)} | {seconds} | {_median(group)} "
            f"| {sum(t.profiles for t in group)} "
            f"| {sum(len(t.left) for t in group)} |"
        )
    return lines


def _median(trials: list[Trial]) -> str:
    """The median time from a kill to its restart recording that it resumed."""
    startup = [s for t in trials for s in t.startup]
    return f"{statistics.median(startup):.1f} s" if startup else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 rounds, 5 kills (not 20, 20)")
    args = parser.parse_args()
    trials = measure(args.quick)
    print("\n".join(table(trials)))
    for i, trial in enumerate(trials, 1):
        for kill in trial.kills:
            print(
                f"run {i}: killed with {kill.committed} committed, round {kill.opened} open; "
                f"restart reached round {kill.reopened} after {kill.restart_seconds} s "
                f"(normal gap {trial.gap:.2f} s)"
            )
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"{os.cpu_count()} cores; load average {load} at the end; {time.strftime('%Y-%m-%d')}")


if __name__ == "__main__":
    main()
