"""The development broker stops and leaves nothing behind, however its wait was interrupted."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from wire.broker import Broker

pytestmark = pytest.mark.integration


def _closes(broker: Broker) -> bool:
    closing = threading.Thread(target=broker.close, daemon=True)
    closing.start()
    closing.join(20)
    return not closing.is_alive()


def test_a_broker_stops_when_an_interrupt_left_popens_wait_lock_held(
    unstarted_broker: Broker,
) -> None:
    # A signal that raises just after Popen.wait took its lock leaves the lock held (an
    # interrupted `with lock:`); a stop through Popen.wait then blocked for ever, which hung
    # `edgesplit broker` on SIGTERM in CI. Held here on purpose, as the interrupt left it.
    broker = unstarted_broker.start()
    process = broker._process
    assert process is not None
    lock = process._waitpid_lock  # type: ignore[attr-defined]
    lock.acquire()
    try:
        assert _closes(broker)
    finally:
        lock.release()  # a stop stuck on it (the bug) then ends, and so does the test
    assert process.returncode is not None
    with pytest.raises(ProcessLookupError):
        os.kill(process.pid, 0)
    assert not broker.directory.exists()


def test_a_broker_that_ignores_sigterm_is_killed(unstarted_broker: Broker) -> None:
    broker = unstarted_broker.start()
    process = broker._process
    assert process is not None
    os.kill(process.pid, signal.SIGSTOP)  #: deaf to SIGTERM until SIGKILL
    assert _closes(broker)
    assert process.returncode == -9
    with pytest.raises(ProcessLookupError):
        os.kill(process.pid, 0)


def test_wait_returns_mosquittos_exit_code(unstarted_broker: Broker) -> None:
    broker = unstarted_broker.start()
    process = broker._process
    assert process is not None
    os.kill(process.pid, signal.SIGTERM)
    assert broker.wait() == 0  # mosquitto exits 0 on SIGTERM
    broker.close()
    assert not broker.directory.exists()
