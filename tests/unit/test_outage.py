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
    expected = r"did not answer for 10 s \(connection failed"
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
