"""Once a simulation's run has finished, SIGINT, SIGTERM and SIGHUP wait until its outputs
are written, then reach the handler that was in place; a third quits at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from types import FrameType

import pytest

from simulation.shield import held_signals

pytestmark = pytest.mark.unit


class _Stopped(Exception):
    pass


@pytest.fixture
def received() -> Iterator[list[int]]:
    """SIGTERM's handler, as the command's: it records the signal and raises."""
    seen: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        seen.append(signum)
        raise _Stopped(signum)

    previous = signal.signal(signal.SIGTERM, handler)
    yield seen
    signal.signal(signal.SIGTERM, previous)


def _sigterm() -> None:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)  # the handler runs in the main thread within this


def test_a_held_signal_reaches_the_handler_when_the_block_ends(
    received: list[int], capfd: pytest.CaptureFixture[str]
) -> None:
    written = []
    with pytest.raises(_Stopped), held_signals() as held:
        held.hold()
        _sigterm()
        written.append("summary.json")  # the block goes on
    assert written == ["summary.json"]
    assert received == [signal.SIGTERM]
    assert "writing its outputs before stopping" in capfd.readouterr().err
    assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL  # the fixture's, back


def test_signals_before_hold_are_not_held(received: list[int]) -> None:
    with pytest.raises(_Stopped), held_signals():
        _sigterm()
    assert received == [signal.SIGTERM]


def test_a_third_signal_quits_at_once(received: list[int]) -> None:
    written = []
    with pytest.raises(_Stopped), held_signals() as held:
        held.hold()
        _sigterm()
        _sigterm()  # timeout signals the process and its group: still held
        assert received == []
        _sigterm()
        written.append("never")
    assert written == []
    assert received == [signal.SIGTERM]


def test_a_block_that_fails_drops_what_it_held(received: list[int]) -> None:
    with pytest.raises(OSError, match="disk full"), held_signals() as held:
        held.hold()
        _sigterm()
        raise OSError("disk full")
    assert received == []  # the error, not the signal, stops the command
    with pytest.raises(_Stopped):
        _sigterm()  # the handler is back in place
    assert received == [signal.SIGTERM]


def test_outside_the_main_thread_nothing_is_held(received: list[int]) -> None:
    handler = signal.getsignal(signal.SIGTERM)
    with held_signals() as held:
        thread = threading.Thread(target=held.hold)
        thread.start()
        thread.join()
        assert signal.getsignal(signal.SIGTERM) is handler
    assert received == []


def test_a_nested_block_hands_over_at_the_outer_end(received: list[int]) -> None:
    order = []
    with pytest.raises(_Stopped), held_signals() as outer:
        with held_signals() as inner:  # simulate() inside the command's block
            assert inner is outer
            inner.hold()
            _sigterm()
        order.append("table printed")
        assert received == []
    assert order == ["table printed"]
    assert received == [signal.SIGTERM]


def test_without_deliver_a_held_signal_ends_nothing(
    received: list[int], capfd: pytest.CaptureFixture[str]
) -> None:
    with held_signals(deliver=False), held_signals() as held:
        held.hold()
        _sigterm()
    assert received == []
    assert "writing its outputs before stopping" in capfd.readouterr().err
    with pytest.raises(_Stopped):
        _sigterm()  # the handler is back in place
    assert received == [signal.SIGTERM]
