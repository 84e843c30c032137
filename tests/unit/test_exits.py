"""Signals the ``edgesplit`` command turns into a stop: the second one does not cut the stop
short (it records the run as cancelled, so it can resume); a third quits at once."""

from __future__ import annotations

import os
import signal
import time

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
