"""What a simulation reports: ``summary.json``, ``rounds.csv``, ``plan.txt`` and ``curves.png``.

Simulated time is what the run would take on the declared devices, from the plan's FLOPs and
bytes per sample and each client's FLOP/s and uplink:

- local-loss: a client computes its prefix and head (3x forward FLOPs a sample, forward and
  backward) and uploads its cut; the two overlap (the client never waits), so a client's round
  takes the larger of the two, plus its segment's weights coming down and going back up once
  a round (at the uplink's rate);
- splitfed (backprop): every batch waits for its gradient, so compute, upload and the gradient's
  download (taken at the uplink's rate: profiles declare one link speed) add up;
- the slowest client bounds the round; the GPU server is taken to keep up (its FLOP/s are
  orders above a client's).
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from split_models.data import Dataset
from split_models.plan import EdgeAssignment
from storage.base import RunStore
from storage.report import clients_of

__all__ = [
    "client_rows",
    "majority_share",
    "round_rows",
    "simulated_round_seconds",
    "write_outputs",
]

log = logging.getLogger(__name__)


def simulated_round_seconds(
    results: Sequence[Any],
    edges: Mapping[str, EdgeAssignment],
    profiles: Mapping[str, Any],
    backprop: bool,
    largest: Mapping[str, int] | None = None,
) -> float:
    """The round's time on the declared devices (see the module docstring); ``largest``: a
    host's examples of its largest client (grouped clients train in parallel on their own
    devices, each as long as its own examples take)."""
    slowest = 0.0
    for result in results:
        edge, profile = edges.get(result.device), profiles.get(result.device)
        if edge is None or profile is None or result.failure:
            continue
        examples = min(result.examples, (largest or {}).get(result.device, result.examples))
        compute = 3 * examples * edge.flops_per_sample / profile.flops
        upload = examples * edge.cut_bytes_per_sample / profile.uplink
        weights = 2 * edge.weight_bytes / profile.uplink  # down and up once a round
        if backprop:
            download = examples * edge.cut_bytes_per_sample / profile.uplink
            slowest = max(slowest, compute + upload + download + weights)
        else:
            slowest = max(slowest, max(compute, upload) + weights)
    return slowest


def _by_device(points: Sequence[Any]) -> dict[str, float]:
    totals: dict[str, float] = {}
    for point in points:
        if point.device is not None:
            totals[point.device] = totals.get(point.device, 0.0) + point.value
    return totals


def round_rows(
    store: RunStore,
    run_id: str,
    edges: Mapping[str, EdgeAssignment],
    profiles: Mapping[str, Any],
    backprop: bool,
    largest: Mapping[str, int] | None = None,
) -> list[dict[str, Any]]:
    """One row per committed round; ``edges``: the stored plan's edge assignments by name
    (``largest``: see :func:`simulated_round_seconds`)."""
    rows: list[dict[str, Any]] = []
    for record in store.list_rounds(run_id):
        if record.state != "committed":  # a try cut short (a resume with none left to train)
            continue
        trained = [r for r in record.results if not r.failure and r.device in profiles]
        federated: dict[str, Any] = {
            key: record.evaluation[key]
            for key in ("federated_accuracy", "federated_loss")
            if key in record.evaluation
        }
        rows.append(
            {
                "round": record.number,
                "accuracy": record.evaluation.get("accuracy"),
                "loss": record.evaluation.get("loss"),
                **federated,
                "participants": len(trained),
                **clients_of(record),
                # the clients' links, as the cut MB of the clients' table (the GPU server's
                # traffic, the same activations again, is in `edgesplit status`)
                "bytes_up": sum(r.bytes_sent for r in record.results if r.device in profiles),
                "bytes_down": sum(r.bytes_received for r in record.results if r.device in profiles),
                "wall_seconds": record.metrics.get("wall_seconds"),
                "simulated_seconds": simulated_round_seconds(
                    record.results, edges, profiles, backprop, largest
                ),
            }
        )
    return rows


def client_rows(
    store: RunStore,
    run_id: str,
    edges: Mapping[str, EdgeAssignment],
    profiles: Mapping[str, Any],
    measured: Mapping[tuple[int, int], int | None],
) -> list[dict[str, Any]]:
    """One row per client; ``measured``: the peak measured for each distinct block range."""
    rounds = store.list_rounds(run_id)
    cut_up = _by_device(store.metrics(run_id, "cut_bytes_sent"))
    cut_down = _by_device(store.metrics(run_id, "cut_bytes_received"))
    clients = []
    for name, profile in profiles.items():
        edge = edges.get(name)
        blocks = edge.blocks if edge is not None else None
        results = [r for record in rounds for r in record.results if r.device == name]
        clients.append(
            {
                "name": name,
                "profile": profile.name,
                "blocks": list(blocks) if blocks else None,
                "budget_bytes": profile.memory,
                "estimated_peak_bytes": edge.estimated_peak_bytes if edge is not None else None,
                "measured_peak_bytes": measured.get(blocks) if blocks else None,
                "bytes_up": sum(r.bytes_sent for r in results),
                "bytes_down": sum(r.bytes_received for r in results),
                "cut_bytes_up": int(cut_up.get(name, 0)),
                "cut_bytes_down": int(cut_down.get(name, 0)),
                "examples": sum(r.examples for r in results if not r.failure),
                "rounds_trained": sum(1 for r in results if not r.failure),
            }
        )
    return clients


def write_outputs(out: Path, summary: Mapping[str, Any], plan_text: str) -> None:
    """``summary.json``, ``plan.txt``, ``rounds.csv`` and ``curves.png`` into ``out``, each
    whole or not at all (written aside, then renamed): a kill mid-write leaves the last
    run's file, never a cut one."""
    with _replacing(out / "summary.json") as path:
        path.write_text(json.dumps(summary, indent=2) + "\n")
    with _replacing(out / "plan.txt") as path:
        path.write_text(plan_text + "\n")
    rows = summary["rounds"]
    with _replacing(out / "rounds.csv") as path, path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]) if rows else ["round"])
        writer.writeheader()
        writer.writerows(rows)
    with _replacing(out / "curves.png") as path:
        write_curves(path, summary)


@contextmanager
def _replacing(path: Path) -> Iterator[Path]:
    """A file beside ``path`` to write; it replaces ``path`` once the block ends without an
    error (a missing one, say matplotlib's absent, leaves ``path`` as it was)."""
    aside = path.with_name(f".{path.name}.tmp")
    try:
        yield aside
        if aside.exists():
            os.replace(aside, path)
    finally:
        aside.unlink(missing_ok=True)


def write_curves(path: Path, summary: Mapping[str, Any]) -> bool:
    """Accuracy and loss against round and against simulated time; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # an optional extra in a trimmed install: the numbers are in the CSV
        log.warning("matplotlib is not installed: %s not written", path.name)
        return False
    rows = [r for r in summary["rounds"] if r.get("accuracy") is not None]
    rounds = [r["round"] for r in rows]
    elapsed, clock = [], 0.0
    for row in rows:
        clock += row.get("simulated_seconds") or 0.0
        elapsed.append(clock)
    figure, axes = plt.subplots(2, 2, figsize=(10, 6.5), layout="constrained")
    for column, (xs, label) in enumerate(
        ((rounds, "round"), (elapsed, "simulated time on the declared devices (s)"))
    ):
        for line, (key, name) in enumerate((("accuracy", "test accuracy"), ("loss", "test loss"))):
            axis = axes[line][column]
            axis.plot(xs, [r[key] for r in rows], marker="o")
            axis.set_xlabel(label)
            axis.set_ylabel(name)
            axis.grid(alpha=0.3)
    figure.suptitle(f"edgesplit simulate: {summary['method']}, run {summary['run_id']}")
    figure.savefig(path, dpi=90, format="png")
    plt.close(figure)
    return True


def majority_share(data: Dataset) -> float:
    """The share of ``data``'s labels held by its most common class: the accuracy of a model
    that always answers it (a run no better has not learned, whatever its chance level)."""
    labels = np.asarray(data.y).reshape(-1)
    return float(np.bincount(labels).max() / len(labels)) if len(labels) else 0.0
