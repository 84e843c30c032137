"""Signals the ``edgesplit`` command turns into a stop: the second one does not cut the stop
short (it records the run as cancelled, so it can resume); a third quits at once."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from edgesplit.exits import Signalled, signals_interrupt

pytestmark = pytest.mark.unit


def _signal_and_wait() -> None:
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.5)  # the handler runs in the main thread within this


def test_the_second_signal_lets_the_stop_finish_and_a_third_quits(
    capfd: pytest.CaptureFixture[str],
) -> None:
    stopped = []
    with signals_interrupt((signal.SIGUSR1,)):
        with pytest.raises(Signalled) as first:
            _signal_and_wait()
        assert first.value.signum == signal.SIGUSR1
        _signal_and_wait()  # arrives while the stop runs: absorbed, the stop goes on
        stopped.append("cancelled")
        with pytest.raises(Signalled):
            _signal_and_wait()
    assert stopped == ["cancelled"]
    assert "stopping already" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL, "the handler is put back"


def test_a_store_given_the_wrong_checkpoint_folder_is_a_usage_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A PostgreSQL store told no --checkpoints exited 1, as a runtime failure."""
    from edgesplit.exits import EXIT_FAILURE, EXIT_USAGE, exit_for
    from storage.errors import StateError, UsageError
    from storage.location import choose_root, unknown_root_error

    assert exit_for("coordinator", unknown_root_error("postgresql://db/runs")) == EXIT_USAGE
    with pytest.raises(UsageError) as moved:
        choose_root(Path("/new"), Path("/old"), None, recorded_exists=True)
    assert exit_for("coordinator", moved.value) == EXIT_USAGE
    assert exit_for("coordinator", StateError("round 3 is committed")) == EXIT_FAILURE
    assert "give one with --checkpoints DIR" in capsys.readouterr().err


def test_a_command_run_in_process_leaves_sigpipe_as_it_found_it(tmp_path: Path) -> None:
    """``main`` set SIGPIPE to its default action for good: a test worker that had run
    ``edgesplit status`` in-process later died without a word (xdist: 'node down: Not properly
    terminated') at a write to a broker socket the broker had closed."""
    from edgesplit.cli import main
    from storage import open_store

    open_store(str(tmp_path / "runs.db")).close()
    before = signal.getsignal(signal.SIGPIPE)
    assert before is signal.SIG_IGN, "Python ignores SIGPIPE"
    assert main(["status", "--db", str(tmp_path / "runs.db")]) == 0
    assert signal.getsignal(signal.SIGPIPE) is before
