"""Edges' real peak memory in a deployment against their plan estimate and budget.

Runs the deployment of the end-to-end tests (``tests/e2e/deployment.py``): a private mosquitto,
a SQLite store, the coordinator, one GPU server and three edges, each its own ``edgesplit``
process, ``cnn`` on mnist8k (or the tiny fixture), batch 32, Adam, fp16 activations, budgets
that force three different cuts. Each edge measures the peak resident memory of every round
(training, encoding and streaming the cut included) and reports it; the table shows it next to
the plan's estimate (training step plus three activation payloads of send buffers) and the
budget. Targets: no round above its edge's budget, and none above the estimate.

    python benchmarks/edge_memory.py [--runs 3] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from _report import Report, machine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the deployment harness lives in tests/e2e

from split_models.units import format_bytes, parse_memory  # noqa: E402
from tests.e2e.deployment import EDGES, SHARED, Deployment  # noqa: E402
from wire.broker import Broker  # noqa: E402
from wire.codec import ENCODINGS  # noqa: E402


@dataclass(frozen=True)
class EdgeRow:
    edge: str
    blocks: list[int]
    budget: int
    estimate: int
    peaks: list[int]  # one per round


def one_run(
    broker: Broker,
    directory: Path,
    rounds: int,
    training: dict[str, str],
    budgets: dict[str, str],
) -> list[EdgeRow]:
    db = f"sqlite:///{directory / 'runs.db'}"
    deployment = Deployment(broker.url, db, directory, rounds, training=training, budgets=budgets)
    try:
        coordinator = deployment.start_all()
        if coordinator.wait(900) != 0:
            raise SystemExit(f"the coordinator failed:\n{deployment.log('coordinator')}")
        status = deployment.status()
    finally:
        deployment.stop()
    plan = {edge["name"]: edge for edge in status["plan"]["edges"]}
    rows = []
    for name in EDGES:
        peaks = [
            int(device["peak_memory_bytes"])
            for record in status["rounds"]
            for device in record["devices"]
            if device["device"] == name
        ]
        rows.append(
            EdgeRow(
                name,
                plan[name]["blocks"],
                parse_memory(budgets[name]),
                int(plan[name]["estimated_peak_bytes"]),
                peaks,
            )
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=3, help="deployments, each a fresh set")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mode", choices=("local-loss", "backprop"), default="local-loss")
    parser.add_argument("--compression", choices=ENCODINGS, default="fp16")
    parser.add_argument(
        "--budgets",
        default=",".join(EDGES.values()),
        help="the three edges' memory, comma-separated (default: %(default)s, three cuts of "
        "the default job)",
    )
    parser.add_argument("--out", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    training = {"mode": args.mode, "compression": args.compression}
    budgets = dict(zip(EDGES, args.budgets.split(","), strict=True))
    report = Report(
        "| run | edge | blocks | budget | estimate | peak per round | highest / estimate |\n"
        "|---|---|---|---|---|---|---|"
    )
    over_budget = over_estimate = 0
    worst = 0.0
    with Broker() as broker:
        for run in range(1, args.runs + 1):
            with tempfile.TemporaryDirectory() as directory:
                rows = one_run(broker, Path(directory), args.rounds, training, budgets)
            for row in rows:
                highest = max(row.peaks)
                over_budget += sum(p > row.budget for p in row.peaks)
                over_estimate += sum(p > row.estimate for p in row.peaks)
                worst = max(worst, highest / row.estimate)
                peaks = ", ".join(format_bytes(p) for p in row.peaks)
                report.row(
                    f"| {run} | {row.edge} | {row.blocks} | {format_bytes(row.budget)} "
                    f"| {format_bytes(row.estimate)} | {peaks} | {highest / row.estimate:.2f} |"
                )
    verdict = "PASS" if over_budget == 0 and over_estimate == 0 else "FAIL"
    data = "mnist8k" if SHARED.exists() else "the tiny fixture"
    report.finish(
        f"\nrounds above budget: {over_budget}, above estimate: {over_estimate}, highest peak / "
        f"estimate {worst:.2f}: {verdict}; data {data}; {args.mode}, {args.compression} "
        f"activations; {machine()}",
        args.out,
    )
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
