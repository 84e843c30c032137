"""Batched client segments: a simulation's clients trained one by one (a pool of ``workers``)
against stacked (``--batched``: clients of the same cut step together in one vmapped call,
``simulation.stack``), on the CPU and, where one is present, on a GPU.

mnist8k's first 6,000 digits (scikit-learn's digits when ../shared is absent), the ``cnn``,
local-loss, Adam 1e-3, batch 32, one round, 16 and 100 clients of two device profiles (so two
cuts, two stacks). Throughput is training samples per second of the round's wall time.

    python benchmarks/batched.py [--clients 16 100] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _report import Report, machine, shared_data

from split_models.runtime import configure_process

configure_process()

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
from simulation.config import SimConfig, parse_sim_config  # noqa: E402
from simulation.simulator import simulate  # noqa: E402

SHARED = shared_data()


def _config(data: str, shape: list[int], clients: int, batched: bool, device: str) -> SimConfig:
    return parse_sim_config(
        {
            "model": "cnn",
            "input_shape": shape,
            "data": data,
            "clients": clients,
            "devices": [
                {"profile": "small", "share": 0.5, "memory": "64MiB", "flops": 2e9},
                {"profile": "large", "share": 0.5, "memory": "512MiB", "flops": 5e10},
            ],
            "rounds": 1,
            "optimizer": {"name": "adam", "lr": 0.001},
            "batched": batched,
            "client_device": device,
            "gpu": {"device": device},
            "measure_memory": False,
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[16, 100])
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        if SHARED.exists():
            with np.load(SHARED) as archive:
                np.savez(work / "train.npz", x=archive["x"][:6000], y=archive["y"][:6000])
            data, shape, name = f"npz:{work / 'train.npz'}", [1, 28, 28], "mnist8k 6,000"
        else:
            data, shape, name = "digits", [1, 8, 8], "digits"
        report = Report(
            f"\n### Batched client segments ({machine()}; GPU: "
            f"{torch.cuda.get_device_name() if 'cuda' in devices else 'none'})\n\n"
            f"`python benchmarks/batched.py --clients {' '.join(map(str, args.clients))}`: "
            f"{name}, cnn, local-loss, one round, batch 32.\n\n"
            "| clients | client device | clients step | training s | samples/s | "
            "client steps per call | accuracy |\n|---|---|---|---|---|---|---|"
        )
        for clients in args.clients:
            for device in devices:
                # one by one, a client's segment stays on the CPU (placing it on a GPU is not
                # built): the GPU rows are stacked, with the GPU server's back there too
                for batched in (False, True) if device == "cpu" else (True,):
                    config = _config(data, shape, clients, batched, device)
                    summary = simulate(config, work / f"{clients}-{device}-{batched}")
                    seconds = summary["training_wall_seconds"]
                    samples = sum(c["examples"] for c in summary["clients"])
                    counts = summary["batched"]
                    per_call = (
                        f"{counts['client_steps'] / max(1, counts['calls']):.1f}"
                        if counts
                        else "1 (one by one)"
                    )
                    report.row(
                        f"| {clients} | {device} | {'stacked' if batched else 'one by one'} | "
                        f"{seconds:.1f} | {samples / seconds:,.0f} | {per_call} | "
                        f"{summary['final_accuracy']:.4f} |"
                    )
    report.finish("", args.out)


if __name__ == "__main__":
    main()
