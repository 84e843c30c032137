"""Shared test setup: process settings first (before torch loads), then common fixtures."""

from __future__ import annotations

from split_models.runtime import configure_process

configure_process()

import os  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import uuid  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from simulation.baselines import use_profile_cache  # noqa: E402
from wire.logs import reset_warnings  # noqa: E402

# Every coordinator and simulation the tests start, in-process or by the CLI (which reads
# EDGESPLIT_PROFILE_CACHE), measures each model profile once per test session, not once per
# process (6-50 s each on two cores): the xdist workers inherit the folder their controller
# made, which alone removes it. The profiling itself is tested where it is called directly.
_OWN_PROFILES = "EDGESPLIT_PROFILE_CACHE" not in os.environ
if _OWN_PROFILES:
    os.environ["EDGESPLIT_PROFILE_CACHE"] = tempfile.mkdtemp(prefix="edgesplit-test-profiles-")
_PROFILES = os.environ["EDGESPLIT_PROFILE_CACHE"]
use_profile_cache(Path(_PROFILES))


# Modules holding the suite's longest tests (30-170 s each on two cores): collected first, so
# the two xdist workers (scripts/check.sh) start on them rather than meet them last. In CI it
# changed little: pytest 1,331 s against 1,349 s without it (one run each).
_LONG = frozenset(
    {
        "test_gallery.py",
        "test_deployment.py",
        "test_store_crash.py",
        "test_coordinator_kill.py",
        "test_cli_operator.py",
        "test_broker_restart.py",
        "test_fast_failure.py",
        "test_federated_split_rounds.py",
        "test_stored_config.py",
        "test_autosplit.py",
    }
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.path.name not in _LONG)  # stable: else in file order


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _OWN_PROFILES:
        shutil.rmtree(_PROFILES, ignore_errors=True)


@pytest.fixture(autouse=True)
def _fresh_warning_allowance() -> None:
    """Warnings are rate-limited per key within a process (wire/logs.py): a test that counts
    on one must not find it spent by an earlier test in the same xdist worker (a node named
    pi-01 contradicted five times elsewhere silenced tests/unit/test_own_will.py in CI)."""
    reset_warnings()


POSTGRES_ADMIN_URL = os.environ.get(
    "EDGESPLIT_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
)


@pytest.fixture
def postgres_url() -> Iterator[str]:
    """A fresh, empty PostgreSQL database for one test, dropped afterwards.

    Skips with the reason when no server answers, except under CI (``CI`` set), where
    ``.ci/run`` starts one and a missing server is a failure.
    """
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import OperationalError

    admin = create_engine(POSTGRES_ADMIN_URL, isolation_level="AUTOCOMMIT")
    name = f"edgesplit_{uuid.uuid4().hex[:12]}"
    try:
        with admin.connect() as connection:
            connection.execute(text(f'CREATE DATABASE "{name}"'))
    except OperationalError as error:
        admin.dispose()
        message = (
            f"PostgreSQL is not reachable at {POSTGRES_ADMIN_URL} "
            f"(set EDGESPLIT_TEST_POSTGRES_URL): {str(error).splitlines()[0]}"
        )
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield make_url(POSTGRES_ADMIN_URL).set(database=name).render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


def _new_broker() -> object:
    """A private mosquitto on a free loopback port, not started; without mosquitto the test
    skips (fails under CI, where ``.ci/run`` installs it)."""
    from wire.broker import Broker
    from wire.errors import TransportError

    try:
        return Broker()
    except TransportError as error:
        if os.environ.get("CI"):
            pytest.fail(str(error))
        pytest.skip(str(error))


@pytest.fixture(scope="module")
def broker() -> Iterator[object]:
    """A private mosquitto on a free loopback port for this test module."""
    with _new_broker() as instance:  # type: ignore[attr-defined]
        yield instance


@pytest.fixture
def unstarted_broker() -> Iterator[object]:
    """A private mosquitto of this test's own, for it to start and stop; closed afterwards
    whatever the test left."""
    instance = _new_broker()
    try:
        yield instance
    finally:
        instance.close()  # type: ignore[attr-defined]
