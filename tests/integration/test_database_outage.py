"""A PostgreSQL server that goes away for a while (a restart, a failover, a network cut): the
store waits for it up to its ``outage_wait``, a coordinator's run goes on through it, and a
command or an outage past the wait fails with one line. The server is seen through a TCP proxy
the test cuts (tests/integration/tcp_proxy.py), so the shared server keeps running."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url

from coordinator.service import Coordinator
from split_models.profiler import ModelProfile
from storage import Event, open_store
from storage.errors import StoreError, UnreachableError
from tests.integration.tcp_proxy import TcpProxy
from tests.integration.test_coordinator_service import EDGES, config, start_fleet
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration


@pytest.fixture
def proxy(postgres_url: str) -> Iterator[TcpProxy]:
    with TcpProxy(make_url(postgres_url).port or 5432) as proxy:
        yield proxy


def _through(url: str, proxy: TcpProxy) -> str:
    parsed = make_url(url).set(host="127.0.0.1", port=proxy.port)
    return parsed.render_as_string(hide_password=False)


def _cut_for(proxy: TcpProxy, seconds: float) -> threading.Timer:
    proxy.cut()
    timer = threading.Timer(seconds, proxy.restore)
    timer.start()
    return timer


def test_a_store_call_during_an_outage_waits_for_the_server(
    postgres_url: str, proxy: TcpProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with open_store(_through(postgres_url, proxy), tmp_path, outage_wait=60) as store:
        store.create_run("out-1", {"model": "cnn"}, seed=0)
        timer = _cut_for(proxy, 2.0)
        began = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="storage.outage"):
            store.add_event("out-1", Event("note", "written once the server is back"))
        waited = time.monotonic() - began
        timer.join()
        assert waited >= 1.5, f"the call waited {waited:.1f} s for a 2 s outage"
    with open_store(postgres_url, tmp_path) as direct:
        assert [e.detail for e in direct.events("out-1")] == ["written once the server is back"]
    said = [r.getMessage() for r in caplog.records]
    assert any("does not answer" in m and "waiting up to 60 s" in m for m in said), said
    assert any("answers again after" in m for m in said), said


def test_an_outage_longer_than_the_wait_is_one_line_naming_it(
    postgres_url: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    with open_store(_through(postgres_url, proxy), tmp_path, outage_wait=1.0) as store:
        store.create_run("out-2", {"model": "cnn"}, seed=0)
        proxy.cut()
        began = time.monotonic()
        with pytest.raises(UnreachableError, match=r"did not answer for 1 s") as raised:
            store.get_run("out-2")
        assert time.monotonic() - began < 15
        assert "\n" not in str(raised.value)


def _cut_at(engine: Engine, proxy: TcpProxy, hook: str, when: Callable[[str], bool]) -> list[str]:
    """Cut the proxy for 1 s the first time the engine's ``hook`` event fires for a statement
    ``when`` accepts (the commit event has none: "")."""
    fired: list[str] = []

    def cut(_connection: object, *args: object) -> None:
        statement = str(args[1]) if len(args) > 1 else ""
        if not fired and when(statement):
            fired.append(statement)
            _cut_for(proxy, 1.0)

    event.listen(engine, hook, cut)
    return fired


def test_a_transaction_cut_off_mid_way_runs_again_once(
    postgres_url: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    with open_store(_through(postgres_url, proxy), tmp_path, outage_wait=60) as store:
        store.create_run("out-4", {"model": "cnn"}, seed=0)
        fired = _cut_at(
            store.engine,
            proxy,
            "before_cursor_execute",
            lambda s: s.startswith("INSERT INTO events"),
        )
        store.add_event("out-4", Event("note", "once"))
        assert fired, "the connection was cut before the insert"
    with open_store(postgres_url, tmp_path) as direct:
        assert [e.detail for e in direct.events("out-4")] == ["once"]


def test_a_read_whose_commit_is_cut_off_runs_again_and_a_writes_fails(
    postgres_url: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    """A transaction that wrote nothing lost nothing at its commit; one that wrote may have
    been kept or not, and is not repeated (a round committed twice, an event recorded twice)."""
    with open_store(_through(postgres_url, proxy), tmp_path, outage_wait=60) as store:
        store.create_run("out-5", {"model": "cnn"}, seed=0)
        fired = _cut_at(store.engine, proxy, "commit", lambda _: True)
        assert store.get_run("out-5").run_id == "out-5"
        assert fired
        time.sleep(1.5)  # the proxy is back
        fired = _cut_at(store.engine, proxy, "commit", lambda _: True)
        with pytest.raises(StoreError, match=r"the database at .* failed") as raised:
            store.add_event("out-5", Event("note", "kept or not"))
        assert fired and not isinstance(raised.value, UnreachableError)


def test_a_command_without_a_wait_fails_at_once(
    postgres_url: str, proxy: TcpProxy, tmp_path: Path
) -> None:
    """``edgesplit status`` against a server that is down answers now, not in two minutes."""
    with open_store(_through(postgres_url, proxy), tmp_path) as store:
        store.create_run("out-3", {"model": "cnn"}, seed=0)
        proxy.cut()
        began = time.monotonic()
        with pytest.raises(StoreError, match=r"the database at .* failed"):
            store.get_run("out-3")
        assert time.monotonic() - began < 15


def test_a_coordinators_run_goes_on_through_a_database_outage(
    postgres_url: str,
    proxy: TcpProxy,
    tmp_path: Path,
    profile: ModelProfile,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, the first store call in the outage raised: the coordinator exited and the
    round under way was lost."""
    run = config(tmp_path, rounds=3)
    hub = InProcessHub()
    start_fleet(hub, tmp_path, dict.fromkeys(EDGES, 1 << 30), {})
    monitor = open_store(postgres_url, tmp_path / "checkpoints")
    cut: list[float] = []

    def cut_after_round_one() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if (monitor.get_run("svc-1").current_round or 0) >= 1:
                    cut.append(time.monotonic())
                    _cut_for(proxy, 4.0).join()
                    return
            except StoreError:  # the run is not created yet
                pass
            time.sleep(0.05)

    watcher = threading.Thread(target=cut_after_round_one, daemon=True)
    watcher.start()
    store = open_store(_through(postgres_url, proxy), tmp_path / "checkpoints", outage_wait=60)
    with store, monitor, caplog.at_level(logging.WARNING, logger="storage.outage"):
        coordinator = Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile)
        assert coordinator.run() == 3
        watcher.join(10)
        assert cut, "the proxy was cut after round 1"
        record = monitor.get_run("svc-1")
        assert (record.status, record.current_round) == ("finished", 3)
    said = [r.getMessage() for r in caplog.records]
    assert any("answers again after" in m for m in said), said
