"""The revision an open compares with (known without importing alembic) is the scripts' head."""

from __future__ import annotations

from storage.migrate import HEAD, READABLE, script_head


def test_head_is_the_newest_migration_script() -> None:
    assert script_head() == HEAD
    assert HEAD in READABLE
