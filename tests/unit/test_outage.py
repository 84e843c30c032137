"""Waiting for a database server (storage/outage.py), with fake sessions and a fake clock:
what is waited for, for how long, and what is said. The real server, cut through a proxy, is
tests/integration/test_database_outage.py."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from sqlalchemy.exc import OperationalError

from storage.errors import UnreachableError
from storage.outage import ServerWait, server_unreachable

pytestmark = pytest.mark.unit

REFUSED = (
    'connection failed: connection to server at "10.0.0.5", port 5432 failed: Connection refused'
)


def _error(reason: str, invalidated: bool = False) -> OperationalError:
    return OperationalError("SELECT 1", {}, Exception(reason), connection_invalidated=invalidated)


@pytest.mark.parametrize(
    "reason",
    [
        REFUSED,
        "consuming input failed: server closed the connection unexpectedly",
        "FATAL:  the database system is starting up",
        "FATAL:  terminating connection due to administrator command",
        "connection timeout expired",
    ],
)
def test_an_absent_server_is_waited_for(reason: str) -> None:
    assert server_unreachable(_error(reason))


@pytest.mark.parametrize(
    "reason",
    [
        'FATAL:  password authentication failed for user "edgesplit"',
        'FATAL:  database "edgesplit" does not exist',
        'FATAL:  no pg_hba.conf entry for host "10.0.0.9"',
        "permission denied for table runs",
    ],
)
def test_a_server_that_answers_with_a_refusal_is_not(reason: str) -> None:
    assert not server_unreachable(_error(reason, invalidated=True))


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


class _Sessions:
    """Sessions whose connection fails ``failures`` times with ``reason``."""

    def __init__(self, failures: int, reason: str = REFUSED) -> None:
        self.failures, self.reason, self.made = failures, reason, 0

    def __call__(self) -> Any:
        owner = self

        class Session:
            def connection(self) -> Any:
                owner.made += 1
                if owner.made <= owner.failures:
                    raise _error(owner.reason)
                return type("Connection", (), {"info": {}})()

            def flush(self) -> None: ...

            def commit(self) -> None: ...

            def rollback(self) -> None: ...

            def close(self) -> None: ...

        return Session()


def test_the_wait_backs_off_and_says_the_outage_once_and_its_end(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = _Clock()
    wait = ServerWait("postgresql://db/edgesplit", 60, sleep=clock.sleep, clock=clock)
    sessions: Any = _Sessions(6)
    with caplog.at_level(logging.WARNING, logger="storage.outage"), wait.session(sessions):
        pass
    assert clock.slept == [0.25, 0.5, 1.0, 2.0, 4.0, 5.0]
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said
    assert "does not answer (connection failed" in said[0] and "up to 60 s" in said[0]
    assert "answers again after 12.8 s" in said[1]


def test_past_the_wait_it_is_one_unreachable_error() -> None:
    clock = _Clock()
    wait = ServerWait("postgresql://db/edgesplit", 10, sleep=clock.sleep, clock=clock)
    sessions: Any = _Sessions(100)
    expected = r"has not answered for 10 s \(--db-outage-wait 10 s\): connection failed"
    with pytest.raises(UnreachableError, match=expected), wait.session(sessions):
        pass
    assert sum(clock.slept) == pytest.approx(10)


@pytest.mark.parametrize("wait_s, reason", [(0, REFUSED), (60, "password authentication failed")])
def test_no_wait_or_a_refusal_fails_at_once(wait_s: float, reason: str) -> None:
    clock = _Clock()
    wait = ServerWait("postgresql://db/edgesplit", wait_s, sleep=clock.sleep, clock=clock)
    sessions: Any = _Sessions(1, reason)
    with pytest.raises(OperationalError), wait.session(sessions):
        pass
    assert clock.slept == []


def test_one_deadline_an_outage_and_after_giving_up_no_call_waits_again() -> None:
    """Each call waited its own --db-outage-wait: a call met late in the outage gave up a
    wait after it began, and the stopping coordinator's later calls (recording the stop,
    releasing the lease) each waited the whole wait again: 4 min 24 s to exit on 120 s."""
    clock = _Clock()
    wait = ServerWait("postgresql://db/edgesplit", 10, sleep=clock.sleep, clock=clock)
    wait._met(0.0, _error(REFUSED))  # another thread met the outage at 0 s
    clock.now = 8.0
    late: Any = _Sessions(100)
    with pytest.raises(UnreachableError, match=r"has not answered for 10 s"), wait.session(late):
        pass
    assert clock.now == pytest.approx(10.0), "the outage's deadline, not 8 + 10 s"
    slept = len(clock.slept)
    after: Any = _Sessions(100)
    with pytest.raises(UnreachableError), wait.session(after):
        pass
    assert len(clock.slept) == slept, "given up: no second wait"
    back: Any = _Sessions(0)
    with wait.session(back):  # the server answers: the next outage is waited for again
        pass
    again: Any = _Sessions(1)
    with wait.session(again):
        pass
    assert len(clock.slept) == slept + 1


def test_an_interrupt_during_the_wait_stops_every_later_wait() -> None:
    """SIGTERM in an outage: the coordinator exited 3 after 250 s, not 143 at once."""
    clock = _Clock()

    def interrupted(_seconds: float) -> None:
        raise KeyboardInterrupt

    wait = ServerWait("postgresql://db/edgesplit", 120, sleep=interrupted, clock=clock)
    first: Any = _Sessions(100)
    with pytest.raises(KeyboardInterrupt), wait.session(first):
        pass
    then: Any = _Sessions(100)
    stopping = r"has not answered for 0 s \(not waited for: stopping\)"
    with pytest.raises(UnreachableError, match=stopping), wait.session(then):  # at once
        pass


def test_a_store_told_to_stop_waiting_fails_at_once_until_the_server_answers() -> None:
    """A coordinator stopping (Ctrl-C, SIGTERM) while it was not itself waiting: recording
    the stop waited the whole outage wait before it could exit."""
    clock = _Clock()
    wait = ServerWait("postgresql://db/edgesplit", 120, sleep=clock.sleep, clock=clock)
    wait.stop()
    down: Any = _Sessions(100)
    with pytest.raises(UnreachableError), wait.session(down):
        pass
    assert clock.slept == []
