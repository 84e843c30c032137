"""The four training methods in one harness (``edgesplit simulate``): local-loss split training,
SplitFed (back-propagation across the cut), FedAvg (whole model per client) and centralized.

mnist8k: the first 6,000 digits train (partitioned over 8 clients, IID and Dirichlet
alpha=0.5), the last 2,000 test; the ``cnn`` model, Adam 1e-3, batch 32, fp32 activations,
equal epochs of data for every method (``--rounds`` rounds of one local epoch; centralized
trains the same number of epochs on the pooled data). Two device profiles (half small: 64 MiB,
2 GFLOP/s, 20 Mbit/s; half large: 512 MiB, 50 GFLOP/s, 100 Mbit/s). Every process setting is
the CLI's (``split_models.runtime``: one torch thread a process, passive OpenMP waits).

    python benchmarks/compare.py [--rounds 3] [--out docs/benchmarks.md]
    python benchmarks/compare.py --sweep [--rounds 5] [--seeds 0,1] [--settings ...]

``--sweep``: the optimizer sweep instead (local-loss, splitfed and centralized for SGD momentum
0.9 at lr 0.01, 0.02, 0.05, 0.1 and Adam 1e-3, IID and Dirichlet(0.5), each seed): the split
methods should reach within 1.5 points of centralized wherever centralized reaches 95%.

Throughput: training samples per second of the rounds' wall time (set-up, profiling and the
memory measurement after training excluded; they are in "wall s"). Bytes per training sample:
everything clients sent/received (weights included) divided by the samples trained; "cut"
counts only the cut layer's activations and labels up and gradients down. Edge peak: each
client's assignment trained in a fresh process (one process hosts every client). Then: the same
local-loss run over mosquitto, centralized with every core, and 10 against 100 clients for the
same data.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _report import Report, machine, shared_data

from split_models.runtime import configure_process

configure_process()  # the CLI's process settings, applied before torch loads

import numpy as np  # noqa: E402
import torch  # noqa: E402

# benchmarks/storage.py would shadow the `storage` package the simulation imports
sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from coordinator.errors import CoordinatorError  # noqa: E402
from simulation.config import SimConfig, parse_sim_config  # noqa: E402
from simulation.simulator import simulate  # noqa: E402

SHARED = shared_data()
METHODS = ("local-loss", "splitfed", "fedavg", "centralized")


PROFILES = [
    {"profile": "small", "share": 0.5, "memory": "64MiB", "flops": 2e9, "uplink": "20Mbit"},
    {"profile": "large", "share": 0.5, "memory": "512MiB", "flops": 5e10, "uplink": "100Mbit"},
]


def _config(
    train: Path,
    test: Path,
    method: str,
    partition: dict[str, Any],
    rounds: int,
    clients: int = 8,
    optimizer: dict[str, Any] | None = None,
    seed: int = 0,
    measure: bool = True,
    extra: dict[str, Any] | None = None,
) -> SimConfig:
    return parse_sim_config(
        {
            "model": "cnn",
            "input_shape": [1, 28, 28],
            "num_classes": 10,
            "data": f"npz:{train}",
            "test_data": f"npz:{test}",
            "clients": clients,
            "partition": partition,
            "devices": PROFILES,
            "gpu": {"memory": "16GiB", "flops": 5e13},
            "rounds": rounds,
            "local_epochs": 1,
            "batch_size": 32,
            "optimizer": optimizer or {"name": "adam", "lr": 0.001},
            "local_loss": "linear",
            "method": method,
            "compression": "fp32",
            "seed": seed,
            "measure_memory": measure,
        }
        | (extra or {})
    )


def _per_sample(summary: dict[str, Any]) -> dict[str, float]:
    samples = sum(c["examples"] for c in summary["clients"]) or 1
    clients = summary["clients"]
    return {
        "up": sum(r["bytes_up"] for r in summary["rounds"]) / samples,
        "down": sum(r["bytes_down"] for r in summary["rounds"]) / samples,
        "cut_up": sum(c["cut_bytes_up"] for c in clients) / samples,
        "cut_down": sum(c["cut_bytes_down"] for c in clients) / samples,
    }


def _throughput(summary: dict[str, Any], samples: int) -> float:
    return samples / summary["training_wall_seconds"]


def _peak(summary: dict[str, Any]) -> str:
    peaks = [c["measured_peak_bytes"] for c in summary["clients"] if c["measured_peak_bytes"]]
    return f"{max(peaks) / 2**20:.1f} MiB" if peaks else "-"


Run = Callable[..., Any]


def _header(rounds: int) -> str:
    return (
        f"\n### Methods compared ({machine()})\n\n"
        f"`python benchmarks/compare.py --rounds {rounds}`: mnist8k 6,000 train / 2,000 "
        f"test, 8 clients, cnn, Adam 1e-3, batch 32, fp32 activations, {rounds} epochs "
        "of data per method, in-process transport, one torch thread a process.\n\n"
        "| partition | method | accuracy | vs central | samples/s | vs central | wall s | "
        "simulated s | bytes up / sample | bytes down / sample | cut up / sample | "
        "cut down / sample | max edge peak |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    )


def _runner(work: Path, rounds: int) -> Run:
    """Simulate one method on the saved split, in its own output folder ``tag``."""

    def run(method: str, partition: dict[str, Any], tag: str, **options: Any) -> Any:
        broker = options.pop("broker", "none")
        config = _config(
            work / "train.npz", work / "test.npz", method, partition, rounds, **options
        )
        return simulate(config, work / tag, broker=broker)

    return run


def _rows(report: Report, name: str, results: dict[str, Any], samples: int) -> None:
    central = results["centralized"]
    for method in METHODS:
        summary = results[method]
        data = _per_sample(summary)
        speed = _throughput(summary, samples)
        report.row(
            f"| {name} | {method} | {summary['final_accuracy']:.4f} | "
            f"{summary['final_accuracy'] - central['final_accuracy']:+.4f} | "
            f"{speed:,.0f} | {speed / _throughput(central, samples):.2f}x | "
            f"{summary['total_wall_seconds']:.1f} | "
            f"{summary['total_simulated_seconds']:.1f} | {data['up']:,.0f} | "
            f"{data['down']:,.0f} | {data['cut_up']:,.0f} | {data['cut_down']:,.0f} | "
            f"{_peak(summary)} |"
        )


def _iid_extras(
    run: Run, results: dict[str, Any], partition: dict[str, Any], samples: int
) -> list[str]:
    """Cut bytes of the two split methods, mosquitto, all-core centralized, 10 vs 100 clients."""
    local, split = _per_sample(results["local-loss"]), _per_sample(results["splitfed"])
    ratio = (local["cut_up"] + local["cut_down"]) / (split["cut_up"] + split["cut_down"])
    extra = [f"- cut-layer bytes, local-loss / splitfed (IID): {ratio:.3f}x"]
    base = _throughput(results["centralized"], samples)
    mqtt = run("local-loss", partition, "mqtt", broker="embedded")
    extra.append(
        f"- local-loss over mosquitto (a private broker on loopback): "
        f"{_throughput(mqtt, samples):,.0f} samples/s, "
        f"{_throughput(mqtt, samples) / base:.2f}x of centralized, accuracy "
        f"{mqtt['final_accuracy']:.4f}"
    )
    torch.set_num_threads(os.cpu_count() or 1)
    wide = run("centralized", partition, "central-all-cores")
    torch.set_num_threads(1)
    wide_speed = _throughput(wide, samples)
    extra.append(
        f"- centralized with {os.cpu_count()} torch threads: "
        f"{wide_speed:,.0f} samples/s; local-loss is "
        f"{_throughput(results['local-loss'], samples) / wide_speed:.2f}x of it"
    )
    return [*extra, _scale(run, partition)]


def _scale(run: Run, partition: dict[str, Any]) -> str:
    small = run("local-loss", partition, "scale-10", clients=10)
    large = run("local-loss", partition, "scale-100", clients=100)
    return (
        f"- 10 vs 100 clients, same data: training {small['training_wall_seconds']:.1f}"
        f" s vs {large['training_wall_seconds']:.1f} s "
        f"({large['training_wall_seconds'] / small['training_wall_seconds']:.2f}x), "
        f"whole run {small['total_wall_seconds']:.1f} s vs "
        f"{large['total_wall_seconds']:.1f} s "
        f"({large['total_wall_seconds'] / small['total_wall_seconds']:.2f}x); "
        f"accuracy {small['final_accuracy']:.4f} vs {large['final_accuracy']:.4f}"
    )


SWEEP = {
    "sgd-m lr 0.01": {"name": "sgd-momentum", "lr": 0.01},
    "sgd-m lr 0.02": {"name": "sgd-momentum", "lr": 0.02},
    "sgd-m lr 0.05": {"name": "sgd-momentum", "lr": 0.05},
    "sgd-m lr 0.1": {"name": "sgd-momentum", "lr": 0.1},
    "adam 1e-3": {"name": "adam", "lr": 0.001},
}
PARTITIONS = {"iid": {"kind": "iid"}, "dirichlet": {"kind": "dirichlet", "alpha": 0.5}}
SWEPT = ("local-loss", "splitfed", "centralized")


def _accuracies(
    work: Path, args: argparse.Namespace, setting: str, partition: str, seed: int
) -> dict[str, tuple[float, float]]:
    """Each swept method's (last, best) round accuracy; NaN for a run that failed; the
    methods ``--only`` leaves out are missing."""
    accuracy = {}
    for method in SWEPT + (("fedavg",) if args.fedavg else ()):
        if args.only and method not in args.only:
            continue
        config = _config(
            work / "train.npz",
            work / "test.npz",
            method,
            PARTITIONS[partition],
            args.rounds,
            optimizer={**SWEEP[setting], **json.loads(args.optimizer)},
            seed=seed,
            measure=False,
            extra=json.loads(args.extra),
        )
        try:
            summary = simulate(config, work / f"{setting}-{partition}-{seed}-{method}")
        except CoordinatorError:  # a round diverged on every attempt
            accuracy[method] = (float("nan"), float("nan"))
            continue
        curve = [r["accuracy"] for r in summary["rounds"]]
        accuracy[method] = (curve[-1], max(curve))
    return accuracy


def _reference(accuracy: dict[str, tuple[float, float]], central: float) -> str:
    """The whole-model FedAvg cells of a sweep row (none when it was not run)."""
    if "fedavg" not in accuracy:
        return ""
    last, best = accuracy["fedavg"]
    return f" {last:.4f} ({best:.4f}) | {last - central:+.4f} |"


def _row(accuracy: dict[str, tuple[float, float]]) -> tuple[str, str]:
    """A sweep row's cells after its setting, and whether it holds ("-": a method of the
    comparison was not run)."""
    ran = [m for m in SWEPT if m in accuracy]
    central = accuracy["centralized"][0] if "centralized" in accuracy else None
    cells = {m: f"{accuracy[m][0]:.4f} ({accuracy[m][1]:.4f})" for m in ran}
    gaps = {
        m: f"{accuracy[m][0] - central:+.4f}"
        for m in ("local-loss", "splitfed")
        if m in accuracy and central is not None
    }
    if len(ran) < len(SWEPT) or central is None:
        holds = "-"
    else:  # NaN (a failed run) fails
        fine = all(accuracy[m][0] - central >= -0.015 for m in ("local-loss", "splitfed"))
        holds = "yes" if central < 0.95 or fine else "NO"
    row = (
        f"{cells.get('centralized', '-')} | {cells.get('local-loss', '-')} | "
        f"{gaps.get('local-loss', '-')} | {cells.get('splitfed', '-')} | "
        f"{gaps.get('splitfed', '-')} | {holds} |"
    )
    if central is not None:
        row += _reference(accuracy, central)
    elif "fedavg" in accuracy:
        row += f" {accuracy['fedavg'][0]:.4f} ({accuracy['fedavg'][1]:.4f}) | - |"
    return row, holds


def _sweep(work: Path, args: argparse.Namespace) -> None:
    """Final accuracy of the split methods against centralized, per optimizer and partition."""
    report = Report(
        f"\n### Optimizer sweep ({machine()})\n\n`python benchmarks/compare.py --sweep "
        f"--rounds {args.rounds} --seeds {args.seeds} --settings '{args.settings}' "
        f"--partitions {args.partitions} --extra '{args.extra}' --optimizer '{args.optimizer}'"
        f"{' --fedavg' if args.fedavg else ''}"
        f"{' --only ' + ','.join(args.only) if args.only else ''}`: "
        "mnist8k 6,000 train / 2,000 test, 8 clients of the two profiles (two cuts), cnn, "
        "batch 32, default training options; accuracy after the last round (best round in "
        "brackets).\n\n"
        "| optimizer | partition | seed | centralized | local-loss | vs central | splitfed "
        f"| vs central | holds |{' fedavg (whole model) | vs central |' if args.fedavg else ''}\n"
        f"|---|---|---|---|---|---|---|---|---|{'---|---|' if args.fedavg else ''}"
    )
    failures = 0
    for setting in args.settings.split(","):
        for partition in args.partitions.split(","):
            for seed in (int(s) for s in args.seeds.split(",")):
                accuracy = _accuracies(work, args, setting, partition, seed)
                row, holds = _row(accuracy)
                failures += holds == "NO"
                report.row(f"| {setting} | {partition} | {seed} | {row}")
    report.finish(
        f"\n{failures} row(s) where a split method is more than 1.5 points below a centralized "
        "run that reaches 95% (nan: a round diverged on all its attempts, the run failed).",
        args.out,
    )


def _arguments() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 3; 5 with --sweep")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--sweep", action="store_true", help="the optimizer sweep instead")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--settings", default=",".join(SWEEP), help=f"of {list(SWEEP)}")
    parser.add_argument("--partitions", default="iid,dirichlet")
    parser.add_argument(
        "--extra", default="{}", help='sweep: SIM.yaml keys as JSON, e.g. {"workers": 1}'
    )
    parser.add_argument(
        "--optimizer",
        default="{}",
        help='sweep: optimizer keys added to each setting, e.g. {"lr_decay": "cosine"}',
    )
    parser.add_argument(
        "--fedavg",
        action="store_true",
        help="sweep: also whole-model FedAvg on the same clients (what federated averaging "
        "alone costs against centralized)",
    )
    parser.add_argument(
        "--only",
        type=lambda text: text.split(","),
        default=[],
        help=f"sweep: run only these of {[*SWEPT, 'fedavg']} (the others' cells show "
        "'-'; a row holds only when all three ran)",
    )
    args = parser.parse_args()
    unknown = set(args.only) - {*SWEPT, "fedavg"}
    if unknown:
        parser.error(f"--only: unknown method(s) {sorted(unknown)}; of {[*SWEPT, 'fedavg']}")
    if "fedavg" in args.only:
        args.fedavg = True
    args.rounds = args.rounds or (5 if args.sweep else 3)
    return args


def main() -> None:
    args = _arguments()
    if not SHARED.exists():
        raise SystemExit(f"needs {SHARED.name} in ../shared/data (offline data of this project)")
    with np.load(SHARED) as archive:
        x, y = archive["x"], archive["y"]
    if args.sweep:
        with tempfile.TemporaryDirectory() as scratch:
            np.savez(Path(scratch) / "train.npz", x=x[:6000], y=y[:6000])
            np.savez(Path(scratch) / "test.npz", x=x[-2000:], y=y[-2000:])
            _sweep(Path(scratch), args)
        return
    samples = 6000 * args.rounds
    report = Report(_header(args.rounds))
    extra: list[str] = []
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        np.savez(work / "train.npz", x=x[:6000], y=y[:6000])
        np.savez(work / "test.npz", x=x[-2000:], y=y[-2000:])
        run = _runner(work, args.rounds)
        for name, partition in (
            ("IID", {"kind": "iid"}),
            ("Dirichlet 0.5", {"kind": "dirichlet", "alpha": 0.5}),
        ):
            results = {method: run(method, partition, f"{name}-{method}") for method in METHODS}
            _rows(report, name, results, samples)
            if name == "IID":
                extra += _iid_extras(run, results, partition, samples)
    report.finish(
        "\nSimulated time is what the run would take on the declared devices; centralized has "
        "no devices (0).\n\n" + "\n".join(extra),
        args.out,
    )


if __name__ == "__main__":
    main()
