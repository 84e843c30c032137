"""Read-only summaries of runs for ``edgesplit status`` (plain dicts, JSON-ready)."""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

from split_models.config import TrainingConfig, stored_section
from split_models.errors import ConfigError
from storage.base import RunStore
from storage.records import ENDED_STATUSES, RoundRecord, RunRecord

__all__ = ["check_run", "clients_of", "round_summary", "run_status", "runs_overview", "spans"]


def round_summary(
    record: RoundRecord, servers: Collection[str] = (), ended: bool = False
) -> dict[str, Any]:
    """One round: state, evaluation, participants and traffic. ``participants`` and
    ``examples`` count the edges (the clients, as a simulation's table does), and so does
    ``failed``; the GPU servers in ``servers``, which train the same examples again on the
    back, are shown apart (``servers``, ``servers_failed``, ``server_examples``), and so is
    the traffic: ``bytes_up``/``bytes_down`` is the edges', ``server_bytes_up``/``_down``
    the servers' (their weights and their streams: the edges' activations again). Where the
    edges are simulation hosts (``group_clients``), ``clients`` counts the clients they
    trained. A round never committed of a run that ``ended`` (finished, failed, cancelled)
    was given up: its state is ``abandoned``, not ``open`` (the store keeps it open, and a
    resume with more rounds trains it anew)."""
    loss = record.evaluation.get("loss", record.metrics.get("loss"))
    state = "abandoned" if ended and record.state != "committed" else record.state
    edges = [r for r in record.results if r.device not in servers]
    backs = [r for r in record.results if r.device in servers]
    return {
        "round": record.number,
        "state": state,
        "accuracy": record.evaluation.get("accuracy"),
        "loss": loss,
        "participants": [d for d in record.participants if d not in servers],
        "servers": [d for d in record.participants if d in servers],
        "failed": sorted(r.device for r in edges if r.failure),
        "servers_failed": sorted(r.device for r in backs if r.failure),
        "examples": sum(r.examples for r in edges if not r.failure),
        **clients_of(record),
        "server_examples": sum(r.examples for r in backs if not r.failure),
        "bytes_up": sum(r.bytes_sent for r in edges),
        "bytes_down": sum(r.bytes_received for r in edges),
        "server_bytes_up": sum(r.bytes_sent for r in backs),
        "server_bytes_down": sum(r.bytes_received for r in backs),
        "committed_at": record.committed_at.isoformat() if record.committed_at else None,
        "devices": [
            {
                "device": r.device,
                "examples": r.examples,
                "loss": r.loss,
                "bytes_sent": r.bytes_sent,
                "bytes_received": r.bytes_received,
                "wall_seconds": r.wall_seconds,
                "peak_memory_bytes": r.peak_memory_bytes,
                "failure": r.failure,
            }
            for r in record.results
        ],
    }


def clients_of(record: RoundRecord) -> dict[str, int]:
    """``{"clients": n}``: the clients a round's edges trained where they are simulation hosts
    of several (``group_clients``); empty otherwise."""
    return {"clients": int(record.metrics["clients"])} if "clients" in record.metrics else {}


def run_status(store: RunStore, run_id: str) -> dict[str, Any]:
    """A run with all its rounds."""
    run = store.get_run(run_id)
    servers = _servers(run, store)
    ended = run.status in ENDED_STATUSES
    return {
        "run_id": run.run_id,
        "status": run.status,
        "seed": run.seed,
        "current_round": run.current_round,
        "plan_version": run.plan_version,
        "plan": run.plan,
        "created_at": run.created_at.isoformat(),
        "updated_at": run.updated_at.isoformat(),
        "rounds": [round_summary(r, servers, ended) for r in store.list_rounds(run_id)],
        "checkpoint": _latest_problem(store, run, deep=True),
        "coordinator": _driver(store, run_id),
    }


def _driver(store: RunStore, run_id: str) -> dict[str, Any] | None:
    """The coordinator that holds the run's lease (None: none does)."""
    lease = store.lease(run_id)
    if lease is None:
        return None
    return {
        "host": lease.host,
        "pid": lease.pid,
        "renewed_seconds_ago": round(lease.age(), 1),
        "expired": lease.expired(),
        "gone": lease.gone(),
        "description": lease.describe(),
    }


def _latest_problem(store: RunStore, run: RunRecord, deep: bool) -> str | None:
    """Why the run's latest committed round cannot be resumed from, or None."""
    if run.current_round is None:
        return None
    return store.round_problem(run.run_id, run.current_round, deep=deep)


def _servers(run: RunRecord, store: RunStore) -> set[str]:
    """The run's GPU servers: those of its stored plan and every device registered as one
    (a round under an earlier plan may name a server the current plan left out)."""
    servers = (run.plan or {}).get("servers", [])
    planned = {s["name"] for s in servers if isinstance(s, dict) and "name" in s}
    return planned | {d.name for d in store.list_devices() if d.kind == "gpu"}


def _rounds_planned(run: RunRecord) -> int | None:
    """The rounds the run's stored configuration asks for (None when it cannot be read: the
    overview still lists the run)."""
    try:
        return stored_section(TrainingConfig, run.config, f"run {run.run_id!r}").rounds
    except ConfigError:
        return None


def _overview(run: RunRecord, rounds: list[RoundRecord], problem: str | None) -> dict[str, Any]:
    committed = [r for r in rounds if r.state == "committed"]
    last = committed[-1] if committed else None
    return {
        "run_id": run.run_id,
        "status": run.status,
        "rounds_committed": len(committed),
        "rounds_planned": _rounds_planned(run),
        "accuracy": last.evaluation.get("accuracy") if last else None,
        "updated_at": run.updated_at.isoformat(),
        "checkpoint": "BAD" if problem else "ok" if run.current_round else "none",
        "checkpoint_problem": problem,
    }


def runs_overview(store: RunStore) -> list[dict[str, Any]]:
    """Every run, one line each; the latest round's checkpoint files checked for presence and
    size only (``status --run`` and ``db check`` verify their hashes)."""
    return [
        _overview(run, store.list_rounds(run.run_id), _latest_problem(store, run, deep=False))
        for run in store.list_runs()
    ]


def check_run(store: RunStore, run_id: str) -> dict[str, Any]:
    """Every committed round's checkpoint verified against its hash: which rounds are usable,
    which not and why, and the round a coordinator would resume from."""
    committed = [r.number for r in store.list_rounds(run_id) if r.state == "committed"]
    problems = {n: store.round_problem(run_id, n) for n in committed}
    usable = [n for n in committed if problems[n] is None]
    return {
        "run_id": run_id,
        "usable": usable,
        "unusable": {n: p for n, p in problems.items() if p is not None},
        "resumes_from": usable[-1] if usable else None,
    }


def spans(numbers: list[int]) -> str:
    """``[1, 2, 3, 5]`` as ``1-3, 5``."""
    runs: list[list[int]] = []
    for number in sorted(numbers):
        if runs and number == runs[-1][-1] + 1:
            runs[-1].append(number)
        else:
            runs.append([number])
    return ", ".join(f"{r[0]}" if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs) or "none"
