"""``edgesplit simulate`` at 10, 100, 1,000 and 10,000 clients on the same data (issue 18):
training time, whole-run time, peak RSS and accuracy.

The job: the ``cnn`` on mnist8k (28x28 digits), local-loss, Adam 1e-3, batch 32, 2 rounds,
half the clients on a 64 MiB profile and half on a 512 MiB one (so two cuts), default workers,
memory not measured in fresh processes. 10 to 1,000 clients split the first 6,000 digits (IID,
so 1,000 clients hold 6 each) and every client trains every round. 10,000 clients need more
samples than mnist8k has: they split 12,000 (the 6,000 and the same shifted by one pixel) and
``strategy: {name: fedavg, fraction_train: 0.01}`` samples 100 of them a round. The test set
is mnist8k's last 2,000 digits. Each run is a fresh ``edgesplit simulate`` process; its peak
RSS is the kernel's high-water mark of that process (``wait4``).

With ``--group``, the same jobs with ``group_clients: true``: one agent per device profile
trains its clients in turn and answers with their examples-weighted mean (simulation.hosts);
"trained a round" counts the clients the hosts trained.

    python benchmarks/scale.py [--clients 10 100 1000 10000] [--group] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _report import Report, machine, shared_data

ROOT = Path(__file__).resolve().parents[1]
SHARED = shared_data()
SAMPLED = 10_000  # from this many clients on, 1% are sampled a round


def _data(work: Path) -> None:
    with np.load(SHARED) as archive:
        x, y = archive["x"], archive["y"]
    np.savez(work / "train.npz", x=x[:6000], y=y[:6000])
    shifted = np.roll(x[:6000], 1, axis=2)
    np.savez(work / "train12k.npz", x=np.concatenate([x[:6000], shifted]), y=np.tile(y[:6000], 2))
    np.savez(work / "test.npz", x=x[-2000:], y=y[-2000:])


def _config(work: Path, clients: int, group: bool) -> Path:
    sampled = clients >= SAMPLED
    lines = [
        "model: cnn",
        "input_shape: [1, 28, 28]",
        "num_classes: 10",
        f"data: npz:{work / ('train12k.npz' if sampled else 'train.npz')}",
        f"test_data: npz:{work / 'test.npz'}",
        f"clients: {clients}",
        "rounds: 2",
        "batch_size: 32",
        "optimizer: {name: adam, lr: 0.001}",
        "measure_memory: false",
        "devices:",
        "  - {profile: small, share: 0.5, memory: 64MiB, flops: 2.0e+9, uplink: 2.0e+7}",
        "  - {profile: large, share: 0.5, memory: 512MiB, flops: 1.0e+10, uplink: 1.0e+8}",
    ]
    if sampled:
        lines.append("strategy: {name: fedavg, fraction_train: 0.01}")
    if group:
        lines.append("group_clients: true")
    path = work / f"sim-{clients}{'-grouped' if group else ''}.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def run(work: Path, clients: int, group: bool = False) -> dict[str, Any]:
    """One simulation in a fresh process: its summary and peak RSS (bytes)."""
    out = work / f"out-{clients}{'-grouped' if group else ''}"
    command = [sys.executable, "-m", "edgesplit", "simulate", "--quiet"]
    command += ["--config", str(_config(work, clients, group)), "--out", str(out)]
    started = time.perf_counter()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"{clients} clients: edgesplit simulate exited {process.returncode}")
    summary = json.loads((out / "summary.json").read_text())
    summary["peak_rss"] = usage.ru_maxrss * 1024
    summary["process_seconds"] = time.perf_counter() - started
    return summary


def _trained(clients: int, group: bool, summary: dict[str, Any]) -> int:
    """Clients trained in round 1: the participants, or the grouped clients the hosts drew
    (half the clients a host, ``fraction_train`` of them, at least one)."""
    if not group:
        return int(summary["rounds"][0]["participants"])
    fraction = 0.01 if clients >= SAMPLED else 1.0
    return sum(max(1, int(n * fraction)) for n in (clients // 2, clients - clients // 2))


def _row(clients: int, summary: dict[str, Any], base: float | None, group: bool) -> str:
    training = summary["training_wall_seconds"]
    ratio = f"{training / base:.2f}x" if base else "-"
    per_round = [_trained(clients, group, summary)]
    return (
        f"| {clients:,} | {per_round[0]:,} | {training:.1f} | {ratio} | "
        f"{summary['process_seconds']:.1f} | {summary['setup_wall_seconds']:.1f} | "
        f"{summary['peak_rss'] / 2**20:,.0f} MiB | {summary['final_accuracy']:.4f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000, 10_000])
    parser.add_argument("--group", action="store_true", help="group_clients: true")
    parser.add_argument("--out", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    if not SHARED.exists():
        sys.exit(f"scale.py: needs {SHARED.relative_to(ROOT.parent)} (mnist8k)")
    report = Report(
        f"### Clients at scale{', grouped' if args.group else ''} ({machine()})\n\n```bash\n"
        f"python benchmarks/scale.py{' --group' if args.group else ''}\n```\n\n"
        "| clients | trained a round | training s | vs 10 | whole run s | setup s | "
        "peak RSS | accuracy |\n|---|---|---|---|---|---|---|---|"
    )
    base = None
    with tempfile.TemporaryDirectory() as folder:
        work = Path(folder)
        _data(work)
        for clients in args.clients:
            summary = run(work, clients, args.group)
            if clients == 10:
                base = summary["training_wall_seconds"]
            report.row(_row(clients, summary, base, args.group))
    load = os.getloadavg()[0]
    report.finish(f"One run each; load average {load:.1f} at the end.", args.out)


if __name__ == "__main__":
    main()
