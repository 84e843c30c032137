"""Where a store keeps its checkpoints, and the pure helpers of ``db check`` and gc."""

from __future__ import annotations

from pathlib import Path

import pytest

from storage import StoreError
from storage.checkpoints import temporary_owner_gone
from storage.location import choose_root, default_root
from storage.report import spans

pytestmark = pytest.mark.unit

DEFAULT = Path("/data/runs.db.checkpoints")


def test_sqlite_keeps_checkpoints_beside_its_file_and_a_server_has_no_default() -> None:
    assert default_root("sqlite:////data/runs.db") == DEFAULT
    assert default_root("postgresql+psycopg://u@h/db") is None


def test_an_explicit_folder_wins_and_is_recorded_unless_it_is_the_default() -> None:
    assert choose_root(Path("/ckpt"), None, None, False).record
    assert not choose_root(DEFAULT, None, DEFAULT, False).record
    assert choose_root(None, Path("/ckpt"), DEFAULT, True).path == Path("/ckpt")
    assert choose_root(None, None, None, False).path is None


def test_a_recorded_folder_that_exists_is_not_replaced_but_a_moved_one_is() -> None:
    with pytest.raises(StoreError, match="keeps its checkpoints in /old"):
        choose_root(Path("/new"), Path("/old"), None, recorded_exists=True)
    moved = choose_root(Path("/new"), Path("/old"), None, recorded_exists=False)
    assert moved.path == Path("/new") and moved.record
    assert choose_root(Path("/new"), Path("/old"), None, True, readonly=True).path == Path("/new")


def test_spans_name_runs_of_rounds() -> None:
    assert spans([5, 1, 2, 3, 7, 8]) == "1-3, 5, 7-8"
    assert spans([]) == "none"


def test_only_this_hosts_ended_processes_leave_collectable_temporary_files() -> None:
    ended = 2**22 + 1  # above the default pid_max: no such process
    assert temporary_owner_gone(f"ab.safetensors.h-{ended}.tmp", host="h")
    assert not temporary_owner_gone(f"ab.safetensors.other-{ended}.tmp", host="h")
    assert not temporary_owner_gone("ab.safetensors.1234.tmp", host="h")  # old naming: by age


def test_a_folder_given_as_the_database_is_named(tmp_path: Path) -> None:
    from storage import open_store

    with pytest.raises(StoreError, match=r"is a folder, not a SQLite database: give the d"):
        open_store(str(tmp_path))
    with open_store(str(tmp_path / "runs.db")):
        pass
    with pytest.raises(StoreError, match=rf"give the file, {tmp_path / 'runs.db'}$"):
        open_store(f"sqlite:///{tmp_path}")


def test_a_file_that_is_no_database_is_named_so(tmp_path: Path) -> None:
    from storage import open_store
    from storage.errors import NotAStoreError

    path = tmp_path / "data.npz"
    path.write_bytes(b"PK\x03\x04" + b"\x00" * 4096)  # a file of something else
    for readonly in (False, True):
        with pytest.raises(NotAStoreError, match=r"not an edgesplit store .*not a database"):
            open_store(f"sqlite:///{path}", readonly=readonly)


def test_another_programs_database_or_an_empty_one_is_not_taken_for_a_store(
    tmp_path: Path,
) -> None:
    """`status --db` on them advised `edgesplit db upgrade`, which would write edgesplit's
    tables into someone else's database; a MySQL URL failed on a missing driver module."""
    import sqlite3

    from storage import open_store
    from storage.errors import NotAStoreError

    other = tmp_path / "other.db"
    with sqlite3.connect(other) as connection:
        connection.execute("CREATE TABLE invoices (id INTEGER)")
    for readonly in (False, True):
        with pytest.raises(NotAStoreError, match=r"not an edgesplit store \(it holds other"):
            open_store(f"sqlite:///{other}", readonly=readonly)
    with sqlite3.connect(other) as connection:  # nothing was written into it
        tables = {row[0] for row in connection.execute("SELECT name FROM sqlite_master")}
    assert tables == {"invoices"}
    empty = tmp_path / "empty.db"
    empty.write_bytes(b"")
    with pytest.raises(NotAStoreError, match=r"no run was ever written to it"):
        open_store(f"sqlite:///{empty}", readonly=True)
    with open_store(f"sqlite:///{empty}"):  # writable: an empty file becomes a new store
        pass
    with pytest.raises(NotAStoreError, match=r"a mysql database is not supported"):
        open_store("mysql://user@localhost/runs")


def test_a_database_failure_while_opening_is_not_called_a_foreign_file() -> None:
    from sqlalchemy.exc import DatabaseError, ProgrammingError

    from storage.engine import opening_error
    from storage.errors import NotAStoreError

    refused = ProgrammingError(
        "ALTER TABLE runs", {}, Exception("permission denied for table runs")
    )
    for url in ("sqlite:///runs.db", "postgresql://db/runs"):
        error = opening_error(url, refused)
        assert not isinstance(error, NotAStoreError) and "permission denied" in str(error)
    foreign = DatabaseError("PRAGMA", {}, Exception("file is not a database"))
    assert isinstance(opening_error("sqlite:///x.npz", foreign), NotAStoreError)


def test_a_write_lock_held_past_the_busy_timeout_points_at_a_frozen_holder() -> None:
    from sqlalchemy.exc import OperationalError

    from storage.engine import database_failure, opening_error

    locked = OperationalError("BEGIN IMMEDIATE", {}, Exception("database is locked"))
    for error in (opening_error("sqlite:///runs.db", locked), database_failure("x", locked)):
        assert "database is locked; another process held its write lock" in str(error)
        assert "frozen" in str(error)
    other = OperationalError("SELECT", {}, Exception("unable to open database file"))
    assert "frozen" not in str(opening_error("sqlite:///runs.db", other))
