"""Several processes write one SQLite store at once while another reads: nothing fails."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from storage import Event, MetricPoint, open_store

pytestmark = pytest.mark.integration

WRITERS, WRITES = 4, 40


def _write(database: str, worker: int) -> None:
    with open_store(database) as store:
        for i in range(WRITES):
            store.add_metrics("shared", [MetricPoint("loss", float(i), device=f"w{worker}")])
            store.add_event("shared", Event("tick", str(i), device=f"w{worker}"))


def _read(database: str) -> None:
    with open_store(database) as store:
        for _ in range(WRITES):
            store.get_run("shared")
            store.metrics("shared")


def test_processes_share_a_sqlite_store_without_lock_errors(tmp_path: Path) -> None:
    database = str(tmp_path / "runs.db")
    with open_store(database) as store:
        store.create_run("shared", {"rounds": 1}, seed=0)
    context = multiprocessing.get_context("fork")
    processes = [context.Process(target=_write, args=(database, w)) for w in range(WRITERS)]
    processes.append(context.Process(target=_read, args=(database,)))
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert [p.exitcode for p in processes] == [0] * (WRITERS + 1)
    with open_store(database) as store:
        assert len(store.metrics("shared")) == WRITERS * WRITES
        assert len(store.events("shared")) == WRITERS * WRITES


def _open_at(database: str, start: object) -> None:
    start.wait(30)  # type: ignore[attr-defined]
    with open_store(database) as store:
        store.list_runs()


@pytest.mark.parametrize("attempt", range(2))
def test_processes_opening_a_new_store_at_once_all_get_it(tmp_path: Path, attempt: int) -> None:
    """The first opens create the schema; one that loses the race waits for the winner's
    (a status query while a simulation starts failed with 'table ... already exists')."""
    database = str(tmp_path / f"new-{attempt}.db")
    context = multiprocessing.get_context("fork")
    start = context.Barrier(WRITERS)
    processes = [context.Process(target=_open_at, args=(database, start)) for _ in range(WRITERS)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(120)
    assert [p.exitcode for p in processes] == [0] * WRITERS
