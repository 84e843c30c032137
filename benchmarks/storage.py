"""Round-commit latency of the run store: 100 devices' results plus a 50 MB checkpoint.

Each round records 100 device results, then commits four 12.5 MB segments (fresh random
weights, so every file is really written and fsynced) in one atomic commit.

    python benchmarks/storage.py [--rounds 5] [--postgres URL] [--out docs/benchmarks.md]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from _report import Report, machine

# This file is named like the package it measures; run as a script, its own folder comes first
# on sys.path and would shadow the package.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

from storage import DeviceResult, RunStore, open_store  # noqa: E402

DEVICES = 100
CHECKPOINT_BYTES = 50 * 10**6
SEGMENTS = 4


def _weights(rng: np.random.Generator) -> dict[str, dict[str, np.ndarray]]:
    per_segment = CHECKPOINT_BYTES // SEGMENTS // 4
    return {
        f"segment-{i}": {"weight": rng.standard_normal(per_segment, dtype=np.float32)}
        for i in range(SEGMENTS)
    }


def _measure(store: RunStore, rounds: int) -> tuple[list[float], list[float]]:
    rng = np.random.default_rng(0)
    store.create_run("bench", {"rounds": rounds}, seed=0)
    results_times, commit_times = [], []
    devices = [f"edge-{i:03d}" for i in range(DEVICES)]
    for number in range(1, rounds + 1):
        store.open_round("bench", number, devices)
        results = [
            DeviceResult(
                device,
                examples=600,
                loss=1.0,
                accuracy=0.5,
                bytes_sent=10**7,
                bytes_received=10**6,
                wall_seconds=3.0,
                peak_memory_bytes=2**27,
            )
            for device in devices
        ]
        started = time.perf_counter()
        store.record_results("bench", number, results)
        results_times.append(time.perf_counter() - started)
        weights = _weights(rng)
        started = time.perf_counter()
        store.commit_round(
            "bench", number, weights, metrics={"loss": 1.0}, evaluation={"accuracy": 0.5}
        )
        commit_times.append(time.perf_counter() - started)
    return results_times, commit_times


def _postgres_available(url: str) -> str | None:
    from sqlalchemy import create_engine, text

    try:
        engine = create_engine(url)
        with engine.connect() as connection:
            connection.execute(text("select 1"))
        engine.dispose()
        return None
    except Exception as error:  # any connection failure means: skip, and say why
        return str(error).splitlines()[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument(
        "--postgres",
        default=os.environ.get(
            "EDGESPLIT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )
    parser.add_argument("--out", type=Path, help="append the table to this markdown file")
    args = parser.parse_args()
    header = (
        "| backend | 100 results, one call (median) | commit 50 MB (median) "
        "| commit (max) | commit MB/s |\n|---|---|---|---|---|"
    )
    report = Report(header)
    with tempfile.TemporaryDirectory() as scratch:
        backends = [("SQLite file", str(Path(scratch) / "bench.db"))]
        reason = _postgres_available(args.postgres)
        if reason is None:
            backends.append(("PostgreSQL", args.postgres))
        else:
            print(f"(PostgreSQL skipped: {reason})")
        for name, url in backends:
            if name == "PostgreSQL":
                _reset_postgres(url)
            with open_store(url, Path(scratch) / f"{name.split()[0].lower()}-checkpoints") as s:
                results, commits = _measure(s, args.rounds)
            median = statistics.median(commits)
            row = (
                f"| {name} | {statistics.median(results) * 1000:.0f} ms | "
                f"{median * 1000:.0f} ms | {max(commits) * 1000:.0f} ms | "
                f"{CHECKPOINT_BYTES / median / 1e6:.0f} |"
            )
            report.row(row)
    report.finish(
        f"\n{args.rounds} rounds each; checkpoint files fsynced on the same disk; {machine()}",
        args.out,
    )
    return 0


def _reset_postgres(url: str) -> None:
    """Drop the benchmark's tables so every run starts from an empty schema."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    with engine.begin() as connection:
        for table in (
            "checkpoints",
            "device_results",
            "metrics",
            "events",
            "rounds",
            "runs",
            "devices",
            "alembic_version",
        ):
            connection.execute(text(f"DROP TABLE IF EXISTS {table} CASCADE"))
    engine.dispose()


if __name__ == "__main__":
    raise SystemExit(main())
