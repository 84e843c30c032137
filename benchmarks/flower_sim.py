"""The same FedAvg job in Flower's own simulation (Ray) and in ``edgesplit simulate --method
fedavg``: wall time, time outside training (start-up, evaluation, shutdown) and peak memory,
side by side (issue 18).

The job: mnist8k's first 6,000 digits split IID over ``--clients`` clients, the last 2,000 as
the test set; the ``cnn``; every client trains the whole model for one local epoch a round,
Adam 1e-3, batch 32; FedAvg; ``--rounds`` rounds; the global model is evaluated on the test set
before training and after every round (Flower's ``evaluate_fn``, edgesplit's own evaluation).
Both sides run the same model code and training step (``split_models.segment.Segment``), one
torch thread a process; Flower's clients get one CPU each (``client_resources``).

Each side runs in a fresh process tree. "peak memory" is the largest sum over that tree (the
command and every process it starts: Ray's GCS, raylet, dashboard agents and workers) of each
process's proportional set size (PSS: shared pages split between their sharers, so the sum
counts each page once), sampled every 0.25 s. "training s" is the sum of the rounds' wall
times: for Flower, from the end of one evaluation to the start of the next (so it includes
sending the weights to the clients, their training and the aggregation), for edgesplit the
rounds' ``wall_seconds``; "outside training" is the rest of the wall time.

Needs Flower's simulation extra, which only this benchmark uses:
``pip install 'flwr[simulation]==1.42.*'`` (Ray). Without it the Flower rows say so.

    python benchmarks/flower_sim.py [--clients 8 100] [--rounds 3] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _report import Report, machine, shared_data

ROOT = Path(__file__).resolve().parents[1]
SHARED = shared_data()
HELP_RAY = "Flower's simulation needs Ray: pip install 'flwr[simulation]==1.42.*'"


def _pss(pid: int) -> int:
    """The proportional set size of ``pid`` in bytes (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            for line in handle:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _tree(root: int) -> list[int]:
    """``root`` and every process below it (Ray's daemons re-parent nowhere while it runs)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def measured(command: list[str]) -> tuple[float, int, str]:
    """Runs ``command``; its wall time, the peak PSS of its process tree, its output."""
    started = time.perf_counter()
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    peak = [0]

    def sample() -> None:
        while process.poll() is None:
            peak[0] = max(peak[0], sum(_pss(pid) for pid in _tree(process.pid)))
            time.sleep(0.25)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    output, _ = process.communicate()
    wall = time.perf_counter() - started
    sampler.join()
    if process.returncode != 0:
        raise RuntimeError(f"{command[2:4]} exited {process.returncode}:\n{output[-3000:]}")
    return wall, peak[0], output


def _child(side: str, clients: int, rounds: int, work: Path) -> list[str]:
    script = ROOT / "benchmarks" / "flower_sim_child.py"
    return [sys.executable, str(script), side, str(clients), str(rounds), str(work)]


def _row(side: str, clients: int, rounds: int, work: Path) -> dict[str, Any]:
    result = work / f"{side}-{clients}.json"
    wall, peak, _ = measured([*_child(side, clients, rounds, work), str(result)])
    found = json.loads(result.read_text())
    return {"wall": wall, "peak": peak, **found}


def _header(rounds: int) -> str:
    return (
        f"\n### Against Flower's own simulation ({machine()})\n\n"
        f"```bash\npython benchmarks/flower_sim.py --rounds {rounds} --out docs/benchmarks.md"
        "\n```\n\nFedAvg, cnn, mnist8k 6,000 train (IID) / 2,000 test, Adam 1e-3, batch 32, "
        f"one local epoch, {rounds} rounds; each side in a fresh process tree, peak memory "
        "as the summed PSS of the tree (see `benchmarks/flower_sim.py`).\n\n"
        "| clients | framework | wall s | training s | outside training s | peak memory | "
        "accuracy |\n|---|---|---|---|---|---|---|"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[8, 100])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not SHARED.exists():
        raise SystemExit(f"needs {SHARED.name} in ../shared/data (offline data of this project)")
    try:
        import ray  # noqa: F401

        sides = ["flower", "edgesplit"]
    except ImportError:
        print(f"no Ray: {HELP_RAY}; only edgesplit's rows are measured", file=sys.stderr)
        sides = ["edgesplit"]
    report = Report(_header(args.rounds))
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        for clients in args.clients:
            for side in ["flower", "edgesplit"]:
                name = "Flower (Ray)" if side == "flower" else "edgesplit simulate"
                if side not in sides:
                    report.row(f"| {clients} | {name} | not run: {HELP_RAY} | | | | |")
                    continue
                row = _row(side, clients, args.rounds, work)
                report.row(
                    f"| {clients} | {name} | {row['wall']:.1f} | {row['training']:.1f} | "
                    f"{row['wall'] - row['training']:.1f} | {row['peak'] / 2**20:,.0f} MiB | "
                    f"{row['accuracy']:.4f} |"
                )
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    report.finish(f"\nLoad average at the end: {load} (Ray's own processes included).", args.out)


if __name__ == "__main__":
    main()
