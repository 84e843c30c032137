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

``--mix memory`` compares per-device cuts with one uniform cut (``devices: {cuts: uniform}``)
on devices whose limits pull the cuts apart: ``sensor`` (0.25 core, 100 Mbit/s, 20 MiB: it can
hold blocks [0, 2) at most), ``mid`` (0.5 core, 20 Mbit/s) and ``phone`` (1 core, 5 Mbit/s: it
wants a deep cut, whose activations are small). Each declares its real link and memory and the
same FLOP/s; both runs re-plan from measured speeds (the default). Run C asks for one cut, run D
(the default) lets each edge take its own.

Needs root and cgroup v1's ``cpu`` controller (``/sys/fs/cgroup/cpu``); elsewhere it says so and
exits 0.

    python benchmarks/heterogeneity.py [--mix declared|memory] [--rounds 4] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import yaml
from _report import machine, shared_data
from shaper import Shaper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from split_models.cpu import cpu_limited, cpu_limits_unavailable  # noqa: E402
from split_models.runtime import RUNTIME_ENV  # noqa: E402
from storage import open_store  # noqa: E402
from wire.broker import Broker  # noqa: E402

# name -> cores, link bit/s, declared memory, declared uplink (None: the link's own rate)
Device = tuple[float, float, str, str | None]
MIXES: dict[str, dict[str, Device]] = {
    "declared": {
        "pi-slow": (0.25, 5e6, "1GiB", "20Mbit"),
        "pi-mid": (0.5, 20e6, "1GiB", "20Mbit"),
        "pi-fast": (1.0, 100e6, "1GiB", "20Mbit"),
    },
    "memory": {
        "sensor": (0.25, 100e6, "20MiB", None),
        "mid": (0.5, 20e6, "1GiB", None),
        "phone": (1.0, 5e6, "1GiB", None),
    },
}
# mix -> run label -> the run's ``devices`` keys
RUNS: dict[str, dict[str, dict[str, object]]] = {
    "declared": {
        "A: plan kept (`replan_drift: null`)": {"replan_drift": None},
        "B: re-planned (0.25, default)": {"replan_drift": 0.25},
    },
    "memory": {
        "C: one cut (`cuts: uniform`)": {"cuts": "uniform"},
        "D: per-device cuts (default)": {"cuts": "per-device"},
    },
}
PER_EDGE, BATCH, DECLARED_FLOPS = 640, 32, "5e9"
SHARED = shared_data()
FIXTURE = ROOT / "tests" / "fixtures" / "tiny_mnist.npz"


def _data(directory: Path, names: list[str]) -> Path:
    source = SHARED if SHARED.exists() else FIXTURE
    with np.load(source) as archive:
        x, y = archive["x"], archive["y"]
    per_edge = min(PER_EDGE, len(x) // (len(names) + 1))
    for index, name in enumerate(names):
        rows = np.arange(index, per_edge * len(names), len(names))
        np.savez(directory / f"{name}.npz", x=x[rows], y=y[rows])
    np.savez(directory / "test.npz", x=x[-1000:], y=y[-1000:])
    return directory / "test.npz"


def _config(
    directory: Path,
    rounds: int,
    edges: list[str],
    keys: dict[str, object],
    extra: dict[str, object],
) -> Path:
    path = directory / "run.yaml"
    devices = {"edges": edges, "gpu_servers": 1, "wait": "120s", **keys}
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
                **extra,
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


def run_once(
    url: str,
    directory: Path,
    rounds: int,
    classes: dict[str, Device],
    keys: dict[str, object],
    extra: dict[str, object],
) -> tuple[list[Row], str]:
    """Each round (see :func:`_rounds`) and the last plan's cuts; ``extra``: more keys of
    the run's config."""
    _data(directory, list(classes))
    config = _config(directory, rounds, list(classes), keys, extra)
    db = f"sqlite:///{directory / 'runs.db'}"
    processes = []
    with contextlib.ExitStack() as stack:
        try:
            gpu = ["gpu-server", "--id", "gpu-a", "--broker", url, "--flops", "5e10"]
            processes.append(_start(directory, "gpu-a", gpu, None))
            host, port = url.removeprefix("mqtt://").rsplit(":", 1)
            for name, (cores, bits, memory, uplink) in classes.items():
                group = stack.enter_context(cpu_limited(f"bench-{name}", cores))
                link = stack.enter_context(Shaper((host, int(port)), bits / 8, bits / 8))
                edge = ["edge", "--id", name, "--broker", f"mqtt://{host}:{link.port}"]
                declared = uplink or f"{bits / 1e6:g}Mbit"
                edge += ["--flops", DECLARED_FLOPS, "--uplink", declared, "--memory", memory]
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


Row = tuple[int, float, float, str, float]


def _rounds(db: str) -> tuple[list[Row], str]:
    """Each round's number, seconds (from the round's start to its commit, and its slowest
    device's training), the cuts it trained at and accuracy, and the run's last plan's cuts
    and predicted round."""
    with open_store(db) as store:
        run = store.get_run("hetero")
        events = store.events("hetero")
        replans = {e.round: e.detail for e in events if e.kind == "replanned"}
        planned = [e.detail.removeprefix("cuts ") for e in events if e.kind == "planned"]
        rows, cuts = [], planned[0] if planned else "?"
        for number in range(1, (run.current_round or 0) + 1):
            record = store.get_round("hetero", number)
            ok = [r.wall_seconds for r in record.results if r.failure is None]
            accuracy = float(record.evaluation.get("accuracy", float("nan")))
            if record.opened_at is None or record.committed_at is None:
                raise SystemExit(f"round {number} has no start or commit time in the store")
            seconds = (record.committed_at - record.opened_at).total_seconds()
            rows.append((number, seconds, max(ok, default=0.0), cuts, accuracy))
            if number in replans:
                cuts = replans[number].rpartition("new cuts ")[2]
        plan = run.plan or {}
        last = {e["name"]: e["blocks"][1] for e in plan.get("edges", [])}
        predicted = float(plan.get("estimated_step_seconds", 0.0)) * -(-PER_EDGE // BATCH)
        return rows, f"{last}, predicted round {predicted:.1f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mix", choices=list(MIXES), default="declared")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--logs", type=Path, default=None, help="keep each run's logs and store")
    parser.add_argument("--only", default=None, help="run only the run whose label starts so")
    parser.add_argument(
        "--set", action="append", default=[], help="KEY=VALUE of the run config (YAML value)"
    )
    args = parser.parse_args()
    if bad := [item for item in args.set if "=" not in item]:
        parser.error(f"--set: expected KEY=VALUE, got {bad}")
    extra = {k: yaml.safe_load(v) for k, _, v in (item.partition("=") for item in args.set)}
    if (why := cpu_limits_unavailable()) is not None:
        print(f"heterogeneity.py: {why}: skipped")
        return
    results = {}
    with Broker() as broker:
        for name, keys in RUNS[args.mix].items():
            label = f"{name}, {', '.join(args.set)}" if args.set else name
            if args.only is not None and not label.startswith(args.only):
                continue
            with tempfile.TemporaryDirectory(prefix="edgesplit-hetero-") as folder:
                classes = MIXES[args.mix]
                results[label] = run_once(
                    broker.url, Path(folder), args.rounds, classes, keys, extra
                )
                if args.logs is not None:
                    kept = args.logs / label[0]
                    kept.mkdir(parents=True, exist_ok=True)
                    for path in [*Path(folder).glob("*.log"), Path(folder) / "runs.db"]:
                        shutil.copy(path, kept)
                print(label, results[label], flush=True)
    header = "| run | round | round s | slowest device's training s | edges' cuts | accuracy |"
    lines = [machine(), "", header, "|---|---|---|---|---|---|"]
    for label, (rows, _) in results.items():
        for number, seconds, training, cuts, accuracy in rows:
            lines.append(
                f"| {label} | {number} | {seconds:.1f} | {training:.1f} | {cuts} | {accuracy:.4f} |"
            )
    lines += ["", *(f"- {label}: last plan {last}" for label, (_, last) in results.items())]
    print("\n".join(lines))
    if args.out is not None:
        with args.out.open("a") as out:
            out.write("\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
