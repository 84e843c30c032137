"""The flags of ``edgesplit runs`` (one run's events, and stopping a run, like ``flwr log``
and ``flwr stop``) and of ``edgesplit export``."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["export_parser", "runs_parser"]


def _positive(value: str) -> int:
    """``--last``: a count of 1 or more (an argparse error otherwise, exit 2)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1, got {value!r}")
    return number


def runs_parser(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    db_flags: Callable[[argparse.ArgumentParser], None],
) -> None:
    """``runs events RUN`` and ``runs stop RUN``; ``db_flags`` adds ``--db`` and its password."""
    runs = commands.add_parser("runs", help="one run's events, or stop a run")
    actions = runs.add_subparsers(dest="action", required=True, metavar="ACTION")
    events = actions.add_parser(
        "events",
        help="list a run's events (failures, refusals, re-plans, cancellation...)",
        description="Print the events the store holds for a run, oldest first.",
    )
    events.add_argument("run", metavar="RUN", help="run id")
    db_flags(events)
    events.add_argument("--json", action="store_true", help="one JSON object per line")
    events.add_argument(
        "--follow",
        "-f",
        action="store_true",
        help="keep printing new events until the run is finished, failed or cancelled",
    )
    events.add_argument(
        "--last", type=_positive, metavar="N", help="only the last N events (default: all)"
    )
    stop = actions.add_parser(
        "stop",
        help="stop a run: its coordinator marks it cancelled and exits (resumable)",
        description="Ask the coordinator driving RUN to stop (it answers within a second, "
        "stops at its next check and marks the run cancelled; the same coordinator command "
        "resumes it later). A run nothing drives is marked cancelled at once.",
    )
    stop.add_argument("run", metavar="RUN", help="run id")
    db_flags(stop)
    stop.add_argument(
        "--wait",
        type=float,
        default=30.0,
        help="seconds to wait for the run to be cancelled (default: %(default)s)",
    )


def export_parser(
    commands: argparse._SubParsersAction,  # type: ignore[type-arg]
    db_flags: Callable[[argparse.ArgumentParser], None],
) -> None:
    """``export``: a run's model (and device segments) as checked ONNX."""
    export = commands.add_parser(
        "export",
        help="export a run's trained model (and device segments) to checked ONNX",
        description="Write the model of a committed round as ONNX with a dynamic batch, run "
        "each file through onnxruntime against torch, and fail above 1e-4.",
    )
    db_flags(export)
    export.add_argument("--run", help="run id (default: the store's only run)")
    export.add_argument("--round", type=int, help="round to export (default: the last committed)")
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument(
        "--per-device",
        action="store_true",
        help="also export each edge device's segment (heads removed)",
    )
    export.add_argument(
        "--allow-model-change",
        action="store_true",
        help="export even when the model's code changed since the round was trained "
        "(layers or their source; refused by default)",
    )
