"""Measured heterogeneity (issue 18): edges of three device classes, re-planned from measured
speeds.

A real deployment: a private mosquitto, SQLite, the coordinator, one GPU server and three edges,
each its own ``edgesplit`` process. Every edge runs in its own cgroup (v1 ``cpu`` controller,
``cpu.cfs_quota_us``) limited to 0.25, 0.5 and 1 core, and reaches the broker through its own
link shaper (``benchmarks/shaper.py``, a token-bucket TCP proxy: ``tc netem`` is missing on this
kernel) of 5, 20 and 100 Mbit/s up and down. All three declare the same device (``--flops 5e9
--uplink 20Mbit``), so the first plan gives them one cut. Run A keeps that plan
(``replan_drift: null``); run B (the default, 0.25) measures each device in round 1, plans again
at the measured speeds and trains the later rounds on the new cuts. Reported: each round's wall
time (its slowest device's, from the store), the cuts it trained at, and the last plan's
predicted round time (its step estimate times the batches of a round) next to the measured one.

Needs root and cgroup v1's ``cpu`` controller (``/sys/fs/cgroup/cpu``); elsewhere it says so and
exits 0.

    python benchmarks/heterogeneity.py [--rounds 4] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import yaml
from _report import machine
from shaper import Shaper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from split_models.runtime import RUNTIME_ENV  # noqa: E402
from storage import open_store  # noqa: E402
from wire.broker import Broker  # noqa: E402

CGROUP = Path("/sys/fs/cgroup/cpu")
CLASSES = {"pi-slow": (0.25, 5e6), "pi-mid": (0.5, 20e6), "pi-fast": (1.0, 100e6)}  # cores, bit/s
PER_EDGE, BATCH, DECLARED = 640, 32, ("5e9", "20Mbit")
SHARED = ROOT.parent / "shared" / "data" / "mnist8k.npz"
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_mnist.npz"


def cgroups_work() -> str | None:
    """None when CPU limits can be set here, else why not."""
    if os.geteuid() != 0:
        return "needs root to create cgroups"
    if not (CGROUP / "cpu.cfs_quota_us").exists():
        return f"no cgroup v1 cpu controller at {CGROUP}"
    return None


@contextlib.contextmanager
def limited(name: str, cores: float) -> Iterator[Path]:
    """A cgroup holding at most ``cores`` CPUs (removed afterwards)."""
    group = CGROUP / f"edgesplit-bench-{name}"
    group.mkdir(exist_ok=True)
    period = int((group / "cpu.cfs_period_us").read_text())
    (group / "cpu.cfs_quota_us").write_text(str(int(cores * period)))
    try:
        yield group
    finally:
        for _ in range(50):
            with contextlib.suppress(OSError):
                group.rmdir()
                break
            time.sleep(0.1)


def _data(directory: Path) -> Path:
    source = SHARED if SHARED.exists() else FIXTURE
    with np.load(source) as archive:
        x, y = archive["x"], archive["y"]
    per_edge = min(PER_EDGE, len(x) // (len(CLASSES) + 1))
    for index, name in enumerate(CLASSES):
        rows = np.arange(index, per_edge * len(CLASSES), len(CLASSES))
        np.savez(directory / f"{name}.npz", x=x[rows], y=y[rows])
    np.savez(directory / "test.npz", x=x[-1000:], y=y[-1000:])
    return directory / "test.npz"


def _config(directory: Path, rounds: int, drift: float | None) -> Path:
    path = directory / "run.yaml"
    edges = list(CLASSES)
    devices = {"edges": edges, "gpu_servers": 1, "wait": "120s", "replan_drift": drift}
    path.write_text(
        yaml.safe_dump(
            {
                "run_id": "hetero",
                "model": "cnn",
                "input_shape": [1, 28, 28],
                "num_classes": 10,
                "eval_data": f"npz:{directory / 'test.npz'}",
                "devices": devices,
                "rounds": rounds,
                "batch_size": BATCH,
                "optimizer": {"name": "adam", "lr": 0.001},
                "round_deadline": "300s",
            }
        )
    )
    return path


def _start(
    directory: Path, name: str, args: list[str], group: Path | None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, **RUNTIME_ENV, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "edgesplit", *args]
    if group is not None:  # join the cgroup before Python starts
        join = f'echo $$ > {group / "cgroup.procs"} && exec "$@"'
        command = ["sh", "-c", join, "sh", *command]
    log = (directory / f"{name}.log").open("ab")
    return subprocess.Popen(command, cwd=directory, env=env, stdout=log, stderr=subprocess.STDOUT)


def run_once(url: str, directory: Path, rounds: int, drift: float | None) -> tuple[list[Row], str]:
    """Each round (see :func:`_rounds`) and the last plan's cuts."""
    _data(directory)
    config, db = _config(directory, rounds, drift), f"sqlite:///{directory / 'runs.db'}"
    processes = []
    with contextlib.ExitStack() as stack:
        try:
            gpu = ["gpu-server", "--id", "gpu-a", "--broker", url, "--flops", "5e10"]
            processes.append(_start(directory, "gpu-a", gpu, None))
            host, port = url.removeprefix("mqtt://").rsplit(":", 1)
            for name, (cores, bits) in CLASSES.items():
                group = stack.enter_context(limited(name, cores))
                link = stack.enter_context(Shaper((host, int(port)), bits / 8, bits / 8))
                edge = ["edge", "--id", name, "--broker", f"mqtt://{host}:{link.port}"]
                edge += ["--flops", DECLARED[0], "--uplink", DECLARED[1], "--memory", "1GiB"]
                edge += ["--data", f"npz:{directory / f'{name}.npz'}"]
                processes.append(_start(directory, name, edge, group))
            coordinator = ["coordinator", "--config", str(config), "--db", db, "--broker", url]
            done = _start(directory, "coordinator", coordinator, None)
            if done.wait(60 * 30) != 0:
                log = (directory / "coordinator.log").read_text()[-3000:]
                raise SystemExit(f"the coordinator failed:\n{log}")
        finally:
            for process in processes:
                process.terminate()
            for process in processes:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    process.wait(30)
    return _rounds(db)


Row = tuple[int, float, str, float]


def _rounds(db: str) -> tuple[list[Row], str]:
    """Each round's number, wall seconds (its slowest device's), the cuts it trained at
    ("first plan" before a re-plan) and accuracy, and the run's last plan's cuts and
    predicted round."""
    with open_store(db) as store:
        run = store.get_run("hetero")
        replans = {e.round: e.detail for e in store.events("hetero") if e.kind == "replanned"}
        rows, cuts = [], "first plan"
        for number in range(1, (run.current_round or 0) + 1):
            record = store.get_round("hetero", number)
            ok = [r.wall_seconds for r in record.results if r.failure is None]
            accuracy = float(record.evaluation.get("accuracy", float("nan")))
            rows.append((number, max(ok, default=0.0), cuts, accuracy))
            if number in replans:
                cuts = replans[number].rpartition("new cuts ")[2]
        plan = run.plan or {}
        last = {e["name"]: e["blocks"][1] for e in plan.get("edges", [])}
        predicted = float(plan.get("estimated_step_seconds", 0.0)) * -(-PER_EDGE // BATCH)
        return rows, f"{last}, predicted round {predicted:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if (why := cgroups_work()) is not None:
        print(f"heterogeneity.py: {why}: skipped")
        return
    results = {}
    runs = {"A: plan kept (`replan_drift: null`)": None, "B: re-planned (0.25, default)": 0.25}
    with Broker() as broker:
        for label, drift in runs.items():
            with tempfile.TemporaryDirectory(prefix="edgesplit-hetero-") as folder:
                results[label] = run_once(broker.url, Path(folder), args.rounds, drift)
                print(label, results[label], flush=True)
    first = next(iter(results.values()))[1].partition(", predicted")[0]  # same declarations
    lines = [machine(), "", "| run | round | round s | edges' cuts | accuracy |"]
    lines.append("|---|---|---|---|---|")
    for label, (rows, _) in results.items():
        for number, seconds, cuts, accuracy in rows:
            shown = first if cuts == "first plan" else cuts
            lines.append(f"| {label} | {number} | {seconds:.1f} | {shown} | {accuracy:.4f} |")
    lines += ["", *(f"- {label}: last plan {last}" for label, (_, last) in results.items())]
    print("\n".join(lines))
    if args.out is not None:
        with args.out.open("a") as out:
            out.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
