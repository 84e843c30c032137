"""``edgesplit runs events RUN`` and ``edgesplit runs stop RUN``."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

from coordinator.stopping import TERMINAL, request_stop
from coordinator.store_commands import open_existing
from split_models.errors import ConfigError
from storage import RunStore
from storage.errors import NotFoundError
from storage.records import Event
from wire.logs import printable

__all__ = ["event_record", "format_event", "runs_command"]

_FOLLOW_POLL = 1.0


def format_event(event: Event) -> str:
    """``2024-05-01 12:00:03  round-failed  round 2  edge-1  why`` (absent parts left out)."""
    when = event.at.strftime("%Y-%m-%d %H:%M:%S") if event.at else "-"
    parts = [when, event.kind]
    if event.round is not None:
        parts.append(f"round {event.round}")
    if event.device:
        parts.append(printable(event.device, 200))
    parts.append(printable(event.detail, 10_000))  # stored before devices' text was escaped
    return "  ".join(p for p in parts if p)


def event_record(event: Event) -> dict[str, object]:
    """The event as plain JSON data."""
    return {
        "at": event.at.isoformat() if event.at else None,
        "kind": event.kind,
        "round": event.round,
        "device": event.device,
        "detail": event.detail,
    }


def _print(events: Sequence[Event], as_json: bool) -> None:
    for event in events:
        print(json.dumps(event_record(event)) if as_json else format_event(event), flush=True)


def _check_run(store: RunStore, run_id: str) -> str:
    try:
        return store.get_run(run_id).status
    except NotFoundError:
        held = ", ".join(r.run_id for r in store.list_runs()[:10]) or "none"
        raise ConfigError(f"run {run_id!r} is not in this store (it holds: {held})") from None


def _awaited_run(store: RunStore, run_id: str) -> str:
    """The run's status, once it is in the store: a run followed before its coordinator has
    created it (both started at once, as a deployment does) is waited for, said once."""
    said = False
    while True:
        try:
            return store.get_run(run_id).status
        except NotFoundError:
            if not said:
                print(f"run {run_id!r} is not in this store yet: waiting for it", file=sys.stderr)
                said = True
        time.sleep(_FOLLOW_POLL)


def events_command(args: argparse.Namespace) -> int:
    """Print the run's events; with ``--follow``, new ones as they come until it ends."""
    with open_existing(args.db, args.db_password) as store:
        status = _awaited_run(store, args.run) if args.follow else _check_run(store, args.run)
        events = store.events(args.run)
        _print(events[-args.last :] if args.last else events, args.json)
        seen = len(events)
        while args.follow and status not in TERMINAL:
            time.sleep(_FOLLOW_POLL)
            status = store.get_run(args.run).status  # read before: no event after it is lost
            events = store.events(args.run)
            _print(events[seen:], args.json)
            seen = len(events)
    return 0


def stop_command(args: argparse.Namespace) -> int:
    """Ask the run's coordinator to stop; mark a run nothing drives cancelled."""
    with open_existing(args.db, args.db_password) as store:
        _check_run(store, args.run)
        print(request_stop(store, args.run, wait=args.wait))
    return 0


def runs_command(args: argparse.Namespace) -> int:
    return events_command(args) if args.action == "events" else stop_command(args)
