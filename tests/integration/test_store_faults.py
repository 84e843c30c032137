"""Storage faults (issue 17): a full disk at commit, read-only stores, a corrupt latest
checkpoint, concurrent opens, where checkpoints live, and orphaned files."""

from __future__ import annotations

import errno
import multiprocessing
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from storage import CheckpointError, CheckpointWriteError, RunStore, StoreError, open_store
from storage.errors import NotAStoreError
from storage.migrate import upgrade
from storage.sql import create_store_engine
from tests.e2e.cli import ROOT
from tests.e2e.cli import run_cli as run

pytestmark = pytest.mark.integration


def _weights(number: int) -> dict[str, dict[str, np.ndarray]]:
    return {"whole": {"w": np.full(5000, number, dtype=np.float32)}}


def _commit(store: RunStore, run_id: str, number: int) -> None:
    store.open_round(run_id, number, ["pi-01"])
    store.commit_round(run_id, number, _weights(number), metrics={"loss": 1.0 / number})


def _stored(database: Path, rounds: int = 3) -> None:
    with open_store(str(database)) as store:
        store.create_run("r", {"model": "cnn"}, seed=0)
        for number in range(1, rounds + 1):
            _commit(store, "r", number)


def _files(folder: Path, pattern: str = "??/*") -> list[Path]:
    return sorted(folder.glob(pattern))


# ---------------------------------------------------------------- a full disk at commit
def test_no_space_at_commit_leaves_nothing_and_the_same_commit_succeeds_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = tmp_path / "runs.db"
    _stored(database, rounds=1)
    real_fsync = os.fsync

    def full(descriptor: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with open_store(str(database)) as store:
        store.open_round("r", 2, ["pi-01"])
        monkeypatch.setattr("storage.checkpoints.os.fsync", full)
        with pytest.raises(CheckpointWriteError) as refused:
            store.commit_round("r", 2, _weights(2))
        message = str(refused.value)
        assert "\n" not in message
        assert "no space left on device" in message
        assert "run the same command again" in message
        assert _files(tmp_path / "runs.db.checkpoints", "??/*.tmp") == []
        assert store.get_run("r").current_round == 1
        assert store.get_round("r", 2).state == "open"
        monkeypatch.setattr("storage.checkpoints.os.fsync", real_fsync)  # space is back
        store.open_round("r", 2, ["pi-01"])
        store.commit_round("r", 2, _weights(2))
        resumed = store.resume("r")
    assert resumed is not None and resumed.round.number == 2
    assert float(resumed.weights["whole"]["w"][0]) == 2.0


def test_an_io_error_while_writing_is_one_line_and_leaves_no_partial_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    database = tmp_path / "runs.db"
    _stored(database, rounds=1)

    def broken(source: object, target: object) -> None:
        raise OSError(errno.EIO, os.strerror(errno.EIO))

    with open_store(str(database)) as store:
        store.open_round("r", 2, ["pi-01"])
        monkeypatch.setattr("storage.checkpoints.os.replace", broken)
        with pytest.raises(CheckpointWriteError, match="input/output error"):
            store.commit_round("r", 2, _weights(2))
    assert _files(tmp_path / "runs.db.checkpoints", "??/*.tmp") == []


# ---------------------------------------------------------------- read-only stores
def _snapshot(folder: Path) -> dict[str, tuple[bytes, int]]:
    return {
        str(p.relative_to(folder)): (p.read_bytes(), p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_status_check_and_reads_of_a_read_only_open_write_nothing(tmp_path: Path) -> None:
    database = tmp_path / "runs.db"
    _stored(database)
    before = _snapshot(tmp_path)
    listing = run("status", "--db", str(database))
    detail = run("status", "--db", str(database), "--run", "r")
    checked = run("db", "check", "--db", str(database))
    with open_store(str(database), readonly=True) as store:
        state = store.checkpoint("r", 3)
        with pytest.raises(StoreError, match="read-only"):
            store.check_can_commit()
    assert listing.returncode == 0 and "r " in listing.stdout, listing.stderr
    assert detail.returncode == 0 and "unusable" not in detail.stdout, detail.stderr
    assert checked.returncode == 0 and "rounds 1-3 usable" in checked.stdout, checked.stderr
    assert float(state.weights["whole"]["w"][0]) == 3.0
    assert _snapshot(tmp_path) == before  # same files, bytes and times: no -wal, no -shm


def test_a_read_only_open_refuses_to_write(tmp_path: Path) -> None:
    database = tmp_path / "runs.db"
    _stored(database, rounds=1)
    with open_store(str(database), readonly=True) as store, pytest.raises(StoreError):
        store.set_run_status("r", "failed")
    with open_store(str(database)) as store:
        assert store.get_run("r").status == "created"


@pytest.fixture
def shared_folder() -> Iterator[Path]:
    """A folder another user can read (pytest's tmp_path is its owner's alone)."""
    folder = Path(tempfile.mkdtemp(prefix="edgesplit-ro-"))
    folder.chmod(0o755)
    try:
        yield folder
    finally:
        for path in [folder, *folder.rglob("*")]:
            if path.is_dir():
                path.chmod(0o755)
        shutil.rmtree(folder)


def _as_reader(*args: str) -> subprocess.CompletedProcess[str]:
    """``edgesplit ARGS`` as a user who may read but not write the store: 'nobody' when the
    tests run as root (root writes through any mode), else this user (the modes stop it)."""
    user = {"user": 65534, "group": 65534, "extra_groups": []} if os.geteuid() == 0 else {}
    try:
        return subprocess.run(
            [sys.executable, "-m", "edgesplit", *args],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=300,
            env={**os.environ, "HOME": tempfile.gettempdir()},
            **user,  # type: ignore[arg-type]
        )
    except PermissionError as error:
        pytest.skip(f"user 'nobody' cannot run this interpreter: {error}")


def test_another_users_store_in_a_folder_it_cannot_write_is_readable(shared_folder: Path) -> None:
    database = shared_folder / "store" / "runs.db"
    _stored(database)
    folder = database.parent
    for path in folder.rglob("*"):
        path.chmod(0o555 if path.is_dir() else 0o444)
    folder.chmod(0o555)
    before = _snapshot(folder)
    listing = _as_reader("status", "--db", str(database))
    checked = _as_reader("db", "check", "--db", str(database))
    assert listing.returncode == 0, listing.stderr
    assert checked.returncode == 0 and "rounds 1-3 usable" in checked.stdout, checked.stderr
    assert not os.access(folder, os.W_OK) or os.geteuid() == 0
    assert _snapshot(folder) == before


def test_a_read_only_open_reads_a_store_at_the_first_revision(tmp_path: Path) -> None:
    database = tmp_path / "old.db"
    engine = create_store_engine(f"sqlite:///{database}")
    upgrade(engine, "0001")
    engine.dispose()
    with open_store(str(database), readonly=True) as store:
        assert store.list_runs() == []


# ---------------------------------------------------------------- a corrupt latest checkpoint
def _corrupt(store: RunStore, run_id: str, number: int) -> None:
    ref = store.checkpoint(run_id, number).checkpoints[0]
    path = store.files.path(ref.sha256)  # type: ignore[attr-defined]
    payload = bytearray(path.read_bytes())
    payload[-1] ^= 0xFF  # same size, another hash
    path.write_bytes(bytes(payload))


def test_a_corrupt_latest_checkpoint_is_shown_and_the_run_resumes_from_the_last_good_round(
    tmp_path: Path,
) -> None:
    database = tmp_path / "runs.db"
    _stored(database)
    with open_store(str(database)) as store:
        _corrupt(store, "r", 3)
    detail = run("status", "--db", str(database), "--run", "r")
    checked = run("db", "check", "--db", str(database))
    with open_store(str(database)) as store:
        resumed = store.resume("r")
        run_after = store.get_run("r")
        reopened = store.get_round("r", 3)
        events = [e for e in store.events("r") if e.kind == "checkpoint-corrupt"]
        metrics = {p.round for p in store.metrics("r")}
        _commit(store, "r", 3)  # the coordinator trains round 3 again, to the same weights
        recommitted = store.checkpoint("r", 3)  # the corrupt file replaced, not kept: it reads
    assert "checkpoint of round 3 is unusable" in detail.stdout, detail.stdout
    assert checked.returncode == 1
    assert "rounds 1-2 usable" in checked.stdout and "resumes from round 2" in checked.stdout
    assert resumed is not None and resumed.round.number == 2
    assert run_after.current_round == 2 and reopened.state == "open"
    assert len(events) == 1 and "round 3" in events[0].detail
    assert 3 not in metrics
    assert recommitted.round.state == "committed"
    assert run("db", "check", "--db", str(database)).returncode == 0


def test_a_run_without_any_usable_checkpoint_is_refused_not_restarted(tmp_path: Path) -> None:
    database = tmp_path / "runs.db"
    _stored(database, rounds=2)
    shutil.rmtree(tmp_path / "runs.db.checkpoints")  # e.g. the wrong folder
    with open_store(str(database)) as store:
        with pytest.raises(CheckpointError, match="no committed round has a usable checkpoint"):
            store.resume("r")
        assert store.get_run("r").current_round == 2


# ---------------------------------------------------------------- concurrent opens
def _open_and_count(url: str, checkpoints: str | None) -> int:
    with open_store(url, checkpoints) as store:
        return len(store.list_runs())


def test_concurrent_opens_of_a_new_sqlite_store_all_succeed(tmp_path: Path) -> None:
    url = str(tmp_path / "runs.db")
    failures: list[BaseException] = []

    def opener() -> None:
        try:
            _open_and_count(url, None)
        except BaseException as error:  # collected for the assertion
            failures.append(error)

    threads = [threading.Thread(target=opener) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        counts = pool.starmap(_open_and_count, [(str(tmp_path / "p.db"), None)] * 3)
    assert failures == []
    assert counts == [0, 0, 0]


def test_concurrent_opens_of_a_new_postgres_store_all_succeed(
    postgres_url: str, tmp_path: Path
) -> None:
    with multiprocessing.get_context("spawn").Pool(3) as pool:
        counts = pool.starmap(_open_and_count, [(postgres_url, str(tmp_path / "ckpt"))] * 3)
    assert counts == [0, 0, 0]


# ---------------------------------------------------------------- where checkpoints live
def test_postgres_records_its_checkpoint_folder_for_commands_run_elsewhere(
    postgres_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with open_store(postgres_url) as store, pytest.raises(StoreError, match="--checkpoints"):
        store.check_can_commit()
    with open_store(postgres_url, tmp_path / "ckpt") as store:
        store.create_run("r", {}, seed=0)
        _commit(store, "r", 1)
    monkeypatch.chdir(tmp_path / "ckpt")  # another directory, no --checkpoints
    with open_store(postgres_url, readonly=True) as store:
        state = store.checkpoint("r", 1)
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(StoreError, match="keeps its checkpoints in"):
        open_store(postgres_url, other)
    assert float(state.weights["whole"]["w"][0]) == 1.0
    assert _files(tmp_path / "ckpt", "??/*.safetensors")


# ---------------------------------------------------------------- orphans
def test_orphans_and_dead_processes_temporary_files_are_collected_on_open_and_by_gc(
    tmp_path: Path,
) -> None:
    database = tmp_path / "runs.db"
    _stored(database, rounds=1)
    folder = tmp_path / "runs.db.checkpoints"
    with open_store(str(database)) as store:
        old, _ = store.files.put({"w": np.full(3, 7.0)})  # type: ignore[attr-defined]
        young, _ = store.files.put({"w": np.full(3, 8.0)})  # type: ignore[attr-defined]
        old_path = store.files.path(old)  # type: ignore[attr-defined]
        young_path = store.files.path(young)  # type: ignore[attr-defined]
    hours_ago = time.time() - 7200
    os.utime(old_path, (hours_ago, hours_ago))
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], **_OUT)
    host = __import__("storage.checkpoints", fromlist=["_HOST"])._HOST
    left = young_path.with_name(f"{young_path.name}.{host}-{int(dead.stdout)}.tmp")
    alive = young_path.with_name(f"{young_path.name}.{host}-{os.getpid()}.tmp")
    left.write_bytes(b"partial")
    alive.write_bytes(b"in flight")
    with open_store(str(database)) as store:
        collected = store.collected_on_open  # type: ignore[attr-defined]
    survivors = set(_files(folder, "??/*"))
    swept = run("db", "gc", "--db", str(database), "--min-age", "0")
    assert collected == 2 and not old_path.exists() and not left.exists()
    assert {young_path, alive} <= survivors
    assert swept.returncode == 0 and "removed 2" in swept.stdout, swept.stdout + swept.stderr
    assert not young_path.exists() and not alive.exists()


_OUT = {"capture_output": True, "text": True, "check": True}


def test_a_database_the_server_does_not_have_is_named_with_the_fix(postgres_url: str) -> None:
    from sqlalchemy.engine import make_url

    missing = make_url(postgres_url).set(database="edgesplit_no_such_db").render_as_string(False)
    with pytest.raises(NotAStoreError, match=r"does not exist; create it first \(createdb"):
        open_store(missing)
