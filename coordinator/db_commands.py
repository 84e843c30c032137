"""``edgesplit db upgrade | check | gc``: maintenance of the run store."""

from __future__ import annotations

import argparse
from typing import Any

from coordinator.store_commands import db_upgrade_command, open_existing
from storage.report import check_run, spans
from wire.mqtt import redact_url

__all__ = ["db_check_command", "db_command", "db_gc_command"]


def db_command(args: argparse.Namespace) -> int:
    """Dispatch ``edgesplit db ACTION``."""
    actions = {"upgrade": db_upgrade_command, "check": db_check_command, "gc": db_gc_command}
    return actions[args.action](args)


def db_check_command(args: argparse.Namespace) -> int:
    """Verify every committed round's checkpoint against its hash (read-only); exit 1 when a
    round cannot be used."""
    with open_existing(args.db, args.db_password, args.checkpoints, readonly=True) as store:
        reports = [check_run(store, run.run_id) for run in store.list_runs()]
        problems = store.integrity_problems()
    for report in reports:
        print(_verdict(report))
    for problem in problems:
        print(f"  {problem}")
    if not reports:
        print(f"database {redact_url(args.db)}: no runs")
    bad = any(r["unusable"] for r in reports) or bool(problems)
    return 1 if bad else 0


def _verdict(report: dict[str, Any]) -> str:
    usable, unusable = report["usable"], report["unusable"]
    rounds = "round" if len(usable) == 1 else "rounds"
    line = f"run {report['run_id']}: {rounds} {spans(usable)} usable"
    if not usable and not unusable:
        return f"run {report['run_id']}: no committed rounds"
    if unusable:
        line += f"; {len(unusable)} unusable, a restarted coordinator resumes from round "
        line += f"{report['resumes_from']}" if report["resumes_from"] else "- (none usable)"
        line += "".join(f"\n  round {n}: {why}" for n, why in sorted(unusable.items()))
    return line


def db_gc_command(args: argparse.Namespace) -> int:
    """Delete checkpoint files no round refers to and abandoned temporary files."""
    with open_existing(args.db, args.db_password, args.checkpoints) as store:
        opened = getattr(store, "collected_on_open", 0)
        removed = opened + store.collect_garbage(args.min_age)
    print(f"database {redact_url(args.db)}: removed {removed} orphaned checkpoint file(s)")
    return 0
