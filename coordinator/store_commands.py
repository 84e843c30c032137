"""``edgesplit status`` and ``edgesplit db upgrade``: the coordinator's view of the run store."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from split_models.errors import ConfigError
from split_models.plan import describe_cuts
from storage import RunStore, normalise_url, open_store
from storage.report import run_status, runs_overview
from wire.mqtt import redact_url

__all__ = ["db_upgrade_command", "export_command", "open_existing", "status_command"]


def open_existing(
    url: str, password: str | None, checkpoints: str | None = None, readonly: bool = False
) -> RunStore:
    """An existing store; ``readonly`` (status, export, db check) writes nothing to it."""
    url = normalise_url(url)
    if url.startswith("sqlite:///"):
        path = Path(url.removeprefix("sqlite:///"))
        if not path.exists():
            raise ConfigError(f"--db: no database at {path}; check the path or run a job first")
    return open_store(url, checkpoints, password=password, readonly=readonly)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4f}"
    if isinstance(value, list):
        return str(len(value))
    return str(value)


def _table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    cells = [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


_LAST_EVENTS = 5
_RUN_COLUMNS = [
    "run_id",
    "status",
    "rounds_committed",
    "rounds_planned",
    "accuracy",
    "checkpoint",
    "updated_at",
]
_ROUND_COLUMNS = [
    "round",
    "state",
    "accuracy",
    "loss",
    "participants",
    "failed",
    "examples",
    "bytes_up",
    "bytes_down",
]


def status_command(args: argparse.Namespace) -> int:
    """List runs, or one run's rounds with their metrics."""
    with open_existing(args.db, args.db_password, args.checkpoints, readonly=True) as store:
        if args.run is None:
            _print_runs(runs_overview(store), args.json)
            return 0
        from storage import NotFoundError

        try:
            status = run_status(store, args.run)
        except NotFoundError as error:
            raise ConfigError(f"--run: {error}") from error
        # a failed or cancelled run: its last events say why (failure messages point there)
        ended = status["status"] in ("failed", "cancelled")
        events = store.events(args.run)
        last = events[-_LAST_EVENTS:] if ended else []
    status["events"] = dict(Counter(e.kind for e in events))  # retries, refusals... at a glance
    if last:
        from coordinator.run_commands import event_record, format_event

        status["last_events"] = [event_record(e) for e in last]
    if args.json:
        print(json.dumps(status, indent=2))
        return 0
    print(
        f"run {status['run_id']}: {status['status']}, last committed round "
        f"{_cell(status['current_round'])}, plan version {status['plan_version']}"
    )
    if (driver := _driver_line(status)) is not None:
        print(driver)
    if (plan := _plan_line(status["plan"])) is not None:
        print(plan)
    if status["checkpoint"]:
        print(
            f"checkpoint of round {status['current_round']} is unusable: {status['checkpoint']}; "
            "`edgesplit db check` lists the usable rounds, a restarted coordinator resumes from "
            "the last of them"
        )
    if status["rounds"]:
        grouped = any("clients" in r for r in status["rounds"])  # simulation hosts' clients
        servers_failed = any(r.get("servers_failed") for r in status["rounds"])
        extra = ["clients"] * grouped + ["servers_failed"] * servers_failed
        print(_table(status["rounds"], _ROUND_COLUMNS + extra))
    if status["events"]:
        counts = ", ".join(f"{kind} {n}" for kind, n in status["events"].items())
        print(f"events: {counts} (edgesplit runs events {args.run})")
    if last:
        print(f"last events (all: edgesplit runs events {args.run}):")
        print("\n".join(f"  {format_event(e)}" for e in last))
    return 0


def _driver_line(status: dict[str, Any]) -> str | None:
    """Which coordinator drives the run; for an unfinished run nobody drives, that nobody does
    (a lease expired, or held by a process of this host that is gone, drives nothing)."""
    driver, last = status.get("coordinator"), ""
    if driver is not None:
        if not driver["gone"]:
            return f"driven by the coordinator with {driver['description']}"
        last = f" (the last one, pid {driver['pid']} on {driver['host']}, is gone)"
    if status["status"] in ("planning", "training"):
        return f"no coordinator drives it now{last}: start the coordinator again to resume"
    return None


def _plan_line(plan: Any, listed: int = 12) -> str | None:
    """``cuts {'pi-01': 2, 'pi-02': 5} (per-device); GPU servers gpu-a [2, 6)`` from a stored
    plan (over ``listed`` edges, how many hold each cut); None for none or a malformed one."""
    try:
        cuts = {str(e["name"]): int(e["blocks"][1]) for e in plan["edges"]}
        backs = [f"{s['name']} [{s['blocks'][0]}, {s['blocks'][1]})" for s in plan["servers"]]
    except (KeyError, TypeError, IndexError, ValueError):
        return None
    shown = describe_cuts(cuts, listed)
    return f"cuts {shown} ({plan.get('cuts', 'per-device')}); GPU servers {', '.join(backs)}"


def _print_runs(runs: list[dict[str, Any]], as_json: bool) -> None:
    if as_json:
        print(json.dumps({"runs": runs}, indent=2))
    elif not runs:
        print("no runs")
    else:
        print(_table(runs, _RUN_COLUMNS))


def db_upgrade_command(args: argparse.Namespace) -> int:
    """Create or migrate the database at ``--db`` to the current schema."""
    with open_store(normalise_url(args.db), args.checkpoints, password=args.db_password) as store:
        runs = len(store.list_runs())
    print(f"database {redact_url(args.db)} is at the current schema ({runs} runs)")
    return 0


def _only_run(store: RunStore) -> str:
    """The run of a store that holds one (a simulation's), or one alone with a committed
    round (beside runs that failed to start); else name them."""
    records = store.list_runs()
    trained = [r.run_id for r in records if r.current_round]
    if len(records) == 1:
        return records[0].run_id
    if len(trained) == 1:
        return trained[0]
    runs = trained or [r.run_id for r in records]
    held = ", ".join(runs[:10]) or "none"
    some = f"{len(runs)} runs with committed rounds" if trained else f"{len(runs)} runs"
    raise ConfigError(f"--run: the store holds {some} ({held}); name one")


def export_command(args: argparse.Namespace) -> int:
    """Export a run's model (and device segments) to ONNX and check each file."""
    from coordinator.export import TOLERANCE, export_run

    with open_existing(args.db, args.db_password, args.checkpoints, readonly=True) as store:
        run = args.run or _only_run(store)
        results = export_run(
            store, run, Path(args.out), args.round, args.per_device, args.allow_model_change
        )
    for result in results:
        verdict = "ok" if result.ok else f"FAILS (> {TOLERANCE:g})"
        print(
            f"{result.path}  blocks [{result.blocks[0]}, {result.blocks[1]})  "
            f"max |onnx - torch| = {result.max_abs_diff:.2e}  {verdict}  "
            f"({result.exporter} exporter)"
        )
    weights = results[0].path.with_suffix(".safetensors")
    print(f"{weights}  the model's state dict (safetensors.torch.load_file, load_state_dict)")
    if failed := [r for r in results if not r.ok]:  # kept, named: a file to look into
        print(
            f"edgesplit export: error: {len(failed)} of {len(results)} file(s) compute other "
            f"outputs than torch (above {TOLERANCE:g}): {', '.join(str(r.path) for r in failed)}; "
            "kept for inspection, do not deploy them",
            file=sys.stderr,
        )
        return 1
    return 0
