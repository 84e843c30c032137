"""The four training methods in one harness (``edgesplit simulate``): local-loss split training,
SplitFed (back-propagation across the cut), FedAvg (whole model per client) and centralized.

mnist8k: the first 6,000 digits train (partitioned over 8 clients, IID and Dirichlet
alpha=0.5), the last 2,000 test; the ``cnn`` model, Adam 1e-3, batch 32, fp32 activations,
equal epochs of data for every method (``--rounds`` rounds of one local epoch; centralized
trains the same number of epochs on the pooled data). Two device profiles (half small: 64 MiB,
2 GFLOP/s, 20 Mbit/s; half large: 512 MiB, 50 GFLOP/s, 100 Mbit/s).

    python benchmarks/compare.py [--rounds 3] [--out docs/benchmarks.md]

Bytes per training sample: everything clients sent/received (weights included) divided by the
samples trained; "cut" counts only activations, labels and gradients. Measured edge memory is
not available in simulation (one process hosts every client); deployments report it.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from _report import Report, machine

# benchmarks/storage.py would shadow the `storage` package the simulation imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from coordinator.simulate import parse_sim_config, simulate  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist8k.npz"
METHODS = ("local-loss", "splitfed", "fedavg", "centralized")


def _config(train: Path, test: Path, method: str, partition: dict[str, Any], rounds: int) -> Any:
    return parse_sim_config(
        {
            "model": "cnn",
            "input_shape": [1, 28, 28],
            "num_classes": 10,
            "data": f"npz:{train}",
            "test_data": f"npz:{test}",
            "clients": 8,
            "partition": partition,
            "devices": [
                {
                    "profile": "small",
                    "share": 0.5,
                    "memory": "64MiB",
                    "flops": 2e9,
                    "uplink": "20Mbit",
                },
                {
                    "profile": "large",
                    "share": 0.5,
                    "memory": "512MiB",
                    "flops": 5e10,
                    "uplink": "100Mbit",
                },
            ],
            "gpu": {"memory": "16GiB", "flops": 5e13},
            "rounds": rounds,
            "local_epochs": 1,
            "batch_size": 32,
            "optimizer": {"name": "adam", "lr": 0.001},
            "local_loss": "linear",
            "method": method,
            "compression": "fp32",
            "seed": 0,
        }
    )


def _bytes(summary: dict[str, Any]) -> tuple[float, float, int]:
    samples = sum(c["examples"] for c in summary["clients"]) or 1
    up = sum(r["bytes_up"] for r in summary["rounds"])
    down = sum(r["bytes_down"] for r in summary["rounds"])
    return up / samples, down / samples, samples


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    if not SHARED.exists():
        raise SystemExit(f"needs {SHARED.name} in ../shared/data (offline data of this project)")
    with np.load(SHARED) as archive:
        x, y = archive["x"], archive["y"]
    report = Report(
        f"\n### Methods compared ({machine()})\n\n"
        f"`python benchmarks/compare.py --rounds {args.rounds}`: mnist8k 6,000 train / 2,000 "
        f"test, 8 clients, cnn, Adam 1e-3, batch 32, fp32 activations, {args.rounds} epochs "
        "of data per method, in-process transport.\n\n"
        "| partition | method | accuracy | vs central | wall s | vs central | simulated s | "
        "bytes up / sample | bytes down / sample |\n|---|---|---|---|---|---|---|---|---|"
    )
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        np.savez(work / "train.npz", x=x[:6000], y=y[:6000])
        np.savez(work / "test.npz", x=x[-2000:], y=y[-2000:])
        for name, partition in (
            ("IID", {"kind": "iid"}),
            ("Dirichlet 0.5", {"kind": "dirichlet", "alpha": 0.5}),
        ):
            results = {}
            for method in METHODS:
                config = _config(
                    work / "train.npz", work / "test.npz", method, partition, args.rounds
                )
                results[method] = simulate(config, work / f"{name}-{method}")
            central = results["centralized"]
            for method in METHODS:
                summary = results[method]
                up, down, _ = _bytes(summary)
                report.row(
                    f"| {name} | {method} | {summary['final_accuracy']:.4f} | "
                    f"{summary['final_accuracy'] - central['final_accuracy']:+.4f} | "
                    f"{summary['total_wall_seconds']:.1f} | "
                    f"{summary['total_wall_seconds'] / central['total_wall_seconds']:.2f}x | "
                    f"{summary['total_simulated_seconds']:.1f} | {up:,.0f} | {down:,.0f} |"
                )
    report.finish(
        "\nSimulated time is what the run would take on the declared devices; centralized has "
        "no devices (0). Targets of issue 6 are judged in docs/benchmarks.md next to this table.",
        args.out,
    )


if __name__ == "__main__":
    main()
