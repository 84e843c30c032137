"""``edgesplit runs events RUN --follow`` started before the run exists (a deployment starts
the coordinator and the follower at once) waits for the run instead of exiting 2."""

from __future__ import annotations

import argparse
import threading
import time
from pathlib import Path

import pytest

from coordinator import run_commands
from storage import open_store
from storage.records import Event

pytestmark = pytest.mark.unit


def test_a_followed_run_that_does_not_exist_yet_is_waited_for(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(run_commands, "_FOLLOW_POLL", 0.02)
    url = f"sqlite:///{tmp_path / 'runs.db'}"
    with open_store(url):
        pass  # the database exists; the run does not

    def coordinator() -> None:
        time.sleep(0.3)
        with open_store(url) as store:
            store.create_run("later", {}, 0)
            store.add_event("later", Event("planned", "cuts {'pi-01': 2}"))
            store.set_run_status("later", "finished")

    started = threading.Thread(target=coordinator)
    started.start()
    args = argparse.Namespace(
        db=url, db_password=None, run="later", follow=True, last=0, json=False
    )
    assert run_commands.events_command(args) == 0
    started.join()
    out, err = capsys.readouterr()
    assert err.count("run 'later' is not in this store yet: waiting for it") == 1, err
    assert "cuts {'pi-01': 2}" in out


def test_a_run_that_does_not_exist_is_an_error_without_follow(tmp_path: Path) -> None:
    from split_models.errors import ConfigError

    url = f"sqlite:///{tmp_path / 'runs.db'}"
    with open_store(url):
        pass
    args = argparse.Namespace(
        db=url, db_password=None, run="nope", follow=False, last=0, json=False
    )
    with pytest.raises(ConfigError, match="'nope' is not in this store"):
        run_commands.events_command(args)
