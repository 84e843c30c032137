"""The ``edgesplit runs`` flags: one run's events, and stopping a run (like ``flwr log`` and
``flwr stop``)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

__all__ = ["runs_parser"]


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
        "--last", type=int, metavar="N", help="only the last N events (default: all)"
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
