"""Faults (issue 17): what an agent killed mid-round and a full checkpoint disk cost a run.

Runs the deployment of the end-to-end tests (``tests/e2e/deployment.py``: a private mosquitto,
SQLite, the coordinator, one GPU server and three edges, each its own ``edgesplit`` process;
``cnn``, 320 examples per edge, batch 32, deadline 30 s, default ``--max-attempts``, 3). After
a warm-up round and two normal ones, each trial SIGKILLs an edge once its second batch of the
round has crossed the broker and starts it again at once; later the GPU server, started again
after 2 s. A round's time is the time between its commit and the one before (retries and back-
off included); a kill's cost is its round's time beyond the median normal round (for the GPU
server, beyond that outage too), goal <= 5 s; the round after it is shown too (the restarted
process builds its segment again). Every committed round is checked for a batch trained twice
(``tests/faults/watch.py``). ENOSPC: a coordinator whose checkpoint folder is a full tmpfs
(root) or gets an injected ENOSPC stops, and the same command resumes. Rows of
``benchmarks/faults_coordinator.py`` and ``benchmarks/faults_broker.py`` join the table when
those modules exist (``rows(quick) -> [(fault, trials, outcome)]``).

    python benchmarks/faults.py [--quick] [--trials 3] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import importlib
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _report import machine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the deployment harness lives in tests/

from storage import open_store  # noqa: E402
from tests.e2e.deployment import Deployment  # noqa: E402
from tests.faults.disk import INJECT, can_mount, full_disk, partial_files  # noqa: E402
from tests.faults.watch import RUN, deployed, read_log, status_of, trained_twice  # noqa: E402
from wire.broker import Broker  # noqa: E402

PER_EDGE, OUTAGE, GOAL = 320, 2.0, 5.0
Row = tuple[str, str, str]
ABOUT = (
    "A real deployment (`tests/e2e/deployment.py`: private mosquitto, SQLite, coordinator, one\n"
    "GPU server, three edges, each its own `edgesplit` process; cnn, 320 examples per edge,\n"
    "batch 32, deadline 30 s, default `--max-attempts`, 3). A kill lands once the round's\n"
    "second batch of the victim (an edge) or of pi-01 (the GPU server) crossed the broker. A\n"
    "round's time is\n"
    "from the previous round's commit to its own (retries and back-off included); a kill costs\n"
    "its round's time beyond the median normal round (the GPU server's: beyond its outage too).\n"
    "Batches trained twice: `tests/faults/watch.py` `trained_twice` over every committed round."
)


def _schedule(trials: int) -> dict[int, str]:
    """Round -> the agent killed in it: rounds 1-3 run clean, then per trial an edge's kill,
    a round after it, the GPU server's kill and a round after that."""
    kills = {}
    for trial in range(trials):
        kills[4 + 4 * trial], kills[6 + 4 * trial] = "edge", "gpu"
    return kills


def _kill(deployment: Deployment, kind: str) -> None:
    if kind == "edge":
        deployment.kill("pi-03")
        deployment.start_edge("pi-03")
    else:
        deployment.kill("gpu-a")
        time.sleep(OUTAGE)
        deployment.start_gpu()


def _round_seconds(deployment: Deployment) -> dict[int, float]:
    """Each round's time: its commit since the previous round's."""
    with open_store(deployment.db, readonly=True) as store:
        stamps = {r.number: r.committed_at for r in store.list_rounds(RUN) if r.committed_at}
    return {n: (stamps[n] - stamps[n - 1]).total_seconds() for n in stamps if n - 1 in stamps}


def measure_kills(broker: Broker, directory: Path, trials: int) -> list[Row]:
    kills = _schedule(trials)
    rounds = max(kills) + 1
    with deployed(broker.url, directory, rounds=rounds, per_edge=PER_EDGE, deadline="30s") as (
        deployment,
        watch,
    ):
        coordinator = deployment.start_all()
        for number, kind in sorted(kills.items()):
            watch.wait_batches("pi-03" if kind == "edge" else "pi-01", number, 2, 900)
            _kill(deployment, kind)
        if coordinator.wait(900 + 120 * rounds) != 0:
            raise SystemExit(f"the coordinator failed:\n{deployment.log('coordinator')}")
        seconds, status = _round_seconds(deployment), status_of(deployment)
        twice = trained_twice(status, PER_EDGE, watch, read_log(directory, "gpu-a"))
    normal = statistics.median(seconds[n] for n in (2, 3))
    rows = [("none: a normal round (rounds 2-3, median)", "2", f"{normal:.1f} s")]
    for kind, label, outage in (
        ("edge", "edge SIGKILLed mid-round, restarted at once", 0.0),
        ("gpu", f"GPU server SIGKILLed mid-round, back after {OUTAGE:.0f} s", OUTAGE),
    ):
        numbers = [n for n, k in kills.items() if k == kind]
        extra = [seconds[n] - normal - outage for n in numbers]
        after = [seconds[n + 1] - normal for n in numbers]
        verdict = "PASS" if max(extra) <= GOAL else "FAIL"
        why = sorted({_failure(status, n) for n in numbers} - {""})
        rows.append(
            (
                label,
                str(len(numbers)),
                f"kill round {_span(extra)} s beyond {'the outage and ' if outage else ''}"
                f"a normal round (goal <= {GOAL:.0f} s: {verdict}); round after {_span(after)} s"
                + (f"; killed device recorded as {', '.join(why)}" if why else ""),
            )
        )
    checked = "none" if not twice else "; ".join(twice)
    rows.append(("(all of the above) batches trained twice", str(rounds), checked))
    return rows


def _failure(status: dict[str, object], number: int) -> str:
    rounds = status["rounds"]
    assert isinstance(rounds, list)
    record = next(r for r in rounds if r["round"] == number)
    return ", ".join(f"{d['device']}: {d['failure']}" for d in record["devices"] if d["failure"])


def _span(values: list[float]) -> str:
    low, high = min(values), max(values)
    return f"{low:+.1f}" if len(values) == 1 else f"{low:+.1f}..{high:+.1f}"


def measure_disk_full(broker: Broker, directory: Path) -> Row:
    """A coordinator whose checkpoint disk is full: its exit, its last line, partial files,
    and the same command once space is back."""
    mode = "tmpfs" if can_mount() else "injected-oserror"
    inject, flag = directory / "inject", directory / "disk-is-full"
    inject.mkdir(parents=True)
    (inject / "sitecustomize.py").write_text(INJECT)
    environment = {"PYTHONPATH": f"{inject}:{ROOT}", "EDGESPLIT_TEST_DISK_FULL_FLAG": str(flag)}
    with deployed(
        broker.url,
        directory / "fleet",
        rounds=2,
        per_edge=64,
        deadline="30s",
        env_for=lambda account: environment if account == "coordinator" else {},
    ) as (deployment, _):
        folder = Path(f"{deployment.directory / 'runs.db'}.checkpoints")
        with full_disk(mode, folder, flag) as free_space:
            code = deployment.start_all().wait(900)
            log = deployment.log("coordinator")
            line = log.strip().splitlines()[-1]
            partial = partial_files(folder)
            free_space()
            started = time.monotonic()
            again = deployment.start_coordinator().wait(900)
            resumed = time.monotonic() - started
            status = status_of(deployment)["status"]
    outcome = (
        f"exit {code}, {'a traceback' if 'Traceback' in log else 'one line'}: `{line[:90]}...`; "
        f"{len(partial)} partial files; the same command: exit {again}, run {status}, "
        f"{resumed:.0f} s"
    )
    return (f"checkpoint disk full at commit ({mode})", "1", outcome)


def sibling_rows(quick: bool) -> list[Row]:
    """Rows of the other fault benchmarks, when they exist."""
    rows: list[Row] = []
    for name in ("faults_coordinator", "faults_broker"):
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name != name:
                raise
            continue
        rows.extend(module.rows(quick))
    return rows


def _shown(rows: list[Row]) -> list[Row]:
    """``rows``, printed at once (the siblings' runs take minutes more)."""
    for row in rows:
        print(" | ".join(row), flush=True)
    return rows


def write_section(out: Path, text: str) -> None:
    """Replace the file's "## Faults" section with ``text`` (or append it)."""
    lines = out.read_text().splitlines() if out.exists() else []
    start = next((i for i, line in enumerate(lines) if line.startswith("## Faults")), None)
    if start is None:
        lines += ["", *text.splitlines()]
    else:
        end = next(
            (i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines)
        )
        lines[start:end] = [*text.splitlines(), ""] if end < len(lines) else text.splitlines()
    out.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one trial of each kill")
    parser.add_argument("--trials", type=int, default=3, help="trials of each kill (default 3)")
    parser.add_argument("--out", type=Path, help="write the table as this file's Faults section")
    parser.add_argument(
        "--no-siblings", action="store_true", help="leave out faults_coordinator/faults_broker"
    )
    args = parser.parse_args()
    trials = 1 if args.quick else args.trials
    rows: list[Row] = []
    with Broker() as broker, tempfile.TemporaryDirectory() as scratch:
        rows += _shown(measure_kills(broker, Path(scratch) / "kills", trials))
        rows += _shown([measure_disk_full(broker, Path(scratch) / "disk")])
    rows += [] if args.no_siblings else _shown(sibling_rows(args.quick))
    table = ["| fault | trials | outcome |", "|---|---|---|"]
    table += [f"| {fault} | {n} | {outcome} |" for fault, n, outcome in rows]
    flags = [f for f, on in (("--quick", args.quick), ("--no-siblings", args.no_siblings)) if on]
    command = " ".join(["python benchmarks/faults.py", *flags])
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    summary = f"{machine()}; load average {load} at the end; {time.strftime('%Y-%m-%d')}"
    print("\n".join(table) + "\n" + summary)
    if args.out is not None:
        heading = ["## Faults (issue 17)", "", "```bash", f".venv/bin/{command}", "```", ""]
        heading += [ABOUT, ""]
        section = "\n".join([*heading, *table, "", summary])
        write_section(args.out, section)


if __name__ == "__main__":
    main()
