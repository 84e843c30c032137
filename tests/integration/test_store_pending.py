"""Checkpoint files of a commit that never finished (killed, disk full) are known to the run:
its next coordinator removes them at once, sparing every file another commit refers to."""

from __future__ import annotations

import errno
import os
import random
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from storage import CheckpointWriteError, open_store
from storage.base import RunStore

pytestmark = pytest.mark.integration


def _weights(number: int, segments: int = 2) -> dict[str, dict[str, np.ndarray]]:
    return {f"seg{i}": {"w": np.full(50_000, number + i / 10, np.float32)} for i in range(segments)}


def _on_disk(store: RunStore) -> set[str]:
    return {sha for sha, _ in store.files.stored()}  # type: ignore[attr-defined]


def _sha(store: RunStore, tensors: dict[str, np.ndarray]) -> str:
    from storage.checkpoints import encode

    return encode(tensors)[0]


def _referenced(store: RunStore, run_id: str) -> set[str]:
    rounds = [r.number for r in store.list_rounds(run_id) if r.state == "committed"]
    return {ref.sha256 for n in rounds for ref in store.checkpoint(run_id, n).checkpoints}


@pytest.fixture(params=["sqlite", "postgresql"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[RunStore]:
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    if request.param == "postgresql":
        url = request.getfixturevalue("postgres_url")
    with open_store(url, tmp_path / "runs.db.checkpoints") as opened:
        opened.create_run("r", {"model": "cnn"}, seed=0)
        opened.open_round("r", 1, ["pi-01"])
        opened.commit_round("r", 1, _weights(1))
        yield opened


def _fail_second_fsync(monkeypatch: pytest.MonkeyPatch) -> None:
    """The disk fills after the commit's first file: a commit that stops half-way."""
    real, calls = os.fsync, []

    def fsync(descriptor: int) -> None:
        calls.append(descriptor)
        if len(calls) == 3:  # file 1, its folder, then file 2
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(descriptor)

    monkeypatch.setattr("storage.checkpoints.os.fsync", fsync)


def test_a_half_written_commits_files_are_removed_by_the_runs_next_start(
    store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.open_round("r", 2, ["pi-01"])
    _fail_second_fsync(monkeypatch)
    with pytest.raises(CheckpointWriteError):
        store.commit_round("r", 2, _weights(2))
    monkeypatch.undo()
    left = _on_disk(store) - _referenced(store, "r")
    assert len(left) == 1, "the first file of the failed commit is on disk"

    removed = store.discard_pending("r")

    assert removed == 1 and _on_disk(store) == _referenced(store, "r")
    assert store.discard_pending("r") == 0


def test_files_another_run_is_committing_or_a_round_refers_to_are_spared(
    store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.create_run("other", {"model": "cnn"}, seed=0)
    store.open_round("other", 1, ["pi-02"])
    store.open_round("r", 2, ["pi-01"])
    shared = {"seg0": _weights(1)["seg0"], "seg1": _weights(7)["seg1"]}  # seg0 as round 1's
    _fail_second_fsync(monkeypatch)
    with pytest.raises(CheckpointWriteError):
        store.commit_round("other", 1, {"mine": _weights(9)["seg0"], **shared})
    monkeypatch.undo()
    mine = store.files.path(_sha(store, _weights(9)["seg0"]))  # type: ignore[attr-defined]
    _fail_second_fsync(monkeypatch)
    with pytest.raises(CheckpointWriteError):  # r's commit refers to the file 'other' wrote
        store.commit_round("r", 2, {"a": _weights(9)["seg0"], **_weights(3, segments=2)})
    monkeypatch.undo()

    assert store.discard_pending("r") == 1, "only r's own file: 'other' still commits 'mine'"
    assert mine.exists()
    assert store.discard_pending("other") == 1 and not mine.exists()
    assert _on_disk(store) == _referenced(store, "r") | _referenced(store, "other")


def test_garbage_collection_spares_a_commit_under_way_until_its_rows_are_old(
    store: RunStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    store.open_round("r", 2, ["pi-01"])
    _fail_second_fsync(monkeypatch)
    with pytest.raises(CheckpointWriteError):
        store.commit_round("r", 2, _weights(2))
    monkeypatch.undo()
    pending = _on_disk(store) - _referenced(store, "r")
    for sha in pending:
        path = store.files.path(sha)  # type: ignore[attr-defined]
        os.utime(path, (time.time() - 7200, time.time() - 7200))

    assert store.collect_garbage(3600) == 0, "a pending row protects an old file"
    assert store.collect_garbage(0) == 1, "rows older than the age are abandoned"


def _commit_forever(database: Path, ready: int) -> None:
    """Child process: commit rounds of run 'r' until killed."""
    with open_store(str(database)) as store:
        number = (store.get_run("r").current_round or 0) + 1
        os.write(ready, b"1")
        while True:
            store.open_round("r", number, ["pi-01"])
            store.commit_round("r", number, _weights(number, segments=3))
            number += 1


def test_after_sigkills_during_commits_a_restart_leaves_only_referenced_files(
    tmp_path: Path,
) -> None:
    database, rng, discarded = tmp_path / "runs.db", random.Random(1), 0
    with open_store(str(database)) as store:
        store.create_run("r", {"model": "cnn"}, seed=0)
    for _ in range(6):
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - the child never returns
            os.close(read_end)
            try:
                _commit_forever(database, write_end)
            finally:
                os._exit(0)
        os.close(write_end)
        os.read(read_end, 1)
        os.close(read_end)
        time.sleep(rng.uniform(0.05, 0.4))
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
        with open_store(str(database)) as restarted:  # .tmp of the dead child: collected
            discarded += restarted.discard_pending("r")
            assert _on_disk(restarted) == _referenced(restarted, "r")
            assert not list((tmp_path / "runs.db.checkpoints").glob("??/*.tmp"))
    print(f"{discarded} file(s) of killed commits removed")
