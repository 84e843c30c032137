"""Partitioner speed: plan time for many devices and deep models (target: 1,000 x 100 < 1 s).

Profiles are synthetic but shaped like a CNN (activations shrink, weights grow with depth),
seeded, so every run plans the same instances.

    python benchmarks/partitioner.py [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
from _report import Report, machine

from coordinator.partitioner import PartitionConfig, plan_split
from split_models.devices import DeviceSpec
from split_models.profiler import BlockProfile, ModelProfile

CASES = [(10, 10, 1), (100, 50, 2), (1000, 100, 1), (1000, 100, 4), (1000, 100, 8)]
TARGET_SECONDS = 1.0


def synthetic_profile(blocks: int, seed: int = 0) -> ModelProfile:
    rng = np.random.default_rng(seed)

    def block(depth: float) -> BlockProfile:
        activation = int(200_000 * (1 - 0.9 * depth) * rng.uniform(0.8, 1.2))
        params = int(4_000 + 2_000_000 * depth**2 * rng.uniform(0.5, 1.5))
        return BlockProfile(
            param_bytes=params,
            buffer_bytes=0,
            largest_param_bytes=params,
            input_shape=(activation // 4,),
            output_shape=(activation // 4,),
            input_bytes=activation,
            output_bytes=activation,
            saved_bytes=2 * activation,
            saved_fixed_bytes=0,
            saves_input=True,
            saves_output=False,
            largest_activation_bytes=activation,
            flops=int(rng.uniform(1e6, 2e7)),
            backward_bytes=2 * activation,
            first_backward_bytes=activation,
        )

    profiles = tuple(block(i / blocks) for i in range(blocks))
    head = BlockProfile(5_000, 0, 5_000, (1,), (10,), 4, 40, 40, 0, True, False, 40, 10_000)
    heads = {"linear": tuple(head for _ in range(blocks + 1))}
    return ModelProfile("synthetic", (1,), 10, profiles, heads)


def fleet(edges: int, servers: int, seed: int = 0) -> list[DeviceSpec]:
    rng = np.random.default_rng(seed)
    devices = [
        DeviceSpec(
            f"edge-{i:04d}",
            "edge",
            int(rng.uniform(64, 4096) * 2**20),
            float(rng.choice([2e9, 1e10, 5e10, 2e11])),
            float(rng.choice([2.5e6, 1.25e7, 1.25e8])),
        )
        for i in range(edges)
    ]
    devices += [
        DeviceSpec(f"gpu-{g}", "gpu", int(rng.uniform(8, 80) * 2**30), 5e13) for g in range(servers)
    ]
    return devices


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    header = (
        "| edges | blocks | GPU servers | plan time (median) | plan time (max) | distinct splits |"
        "\n|---|---|---|---|---|---|"
    )
    report = Report(header)
    worst = 0.0
    config = PartitionConfig(batch_size=32)
    for edges, blocks, servers in CASES:
        profile, devices = synthetic_profile(blocks), fleet(edges, servers)
        times = []
        for _ in range(args.repeat):
            started = time.perf_counter()
            plan = plan_split(profile, devices, config)
            times.append(time.perf_counter() - started)
        splits = len({edge.blocks[1] for edge in plan.edges})
        if (edges, blocks) == (1000, 100):
            worst = max(worst, max(times))
        row = (
            f"| {edges} | {blocks} | {servers} | {statistics.median(times) * 1000:.1f} ms "
            f"| {max(times) * 1000:.1f} ms | {splits} |"
        )
        report.row(row)
    verdict = "PASS" if worst < TARGET_SECONDS else "FAIL"
    summary = (
        f"\n1,000 edges x 100 blocks: worst {worst:.3f} s (target < {TARGET_SECONDS} s): "
        f"{verdict}; {machine()}"
    )
    report.finish(summary, args.out)
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
