"""A PostgreSQL server that goes away for a while (a restart, a failover, a network cut): the
store waits for it up to its ``outage_wait``, a coordinator's run goes on through it, and a
command or an outage past the wait fails with one line. The server is seen through a TCP proxy
the test cuts (tests/integration/tcp_proxy.py), so the shared server keeps running."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import event
from sqlalchemy.engine import Engine, make_url

from coordinator.service import Coordinator
from split_models.profiler import ModelProfile
from storage import Event, RunStore, open_store
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
        expected = r"has not answered for 1 s \(--db-outage-wait 1 s\)"
        with pytest.raises(UnreachableError, match=expected) as raised:
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


def test_a_commit_cut_off_is_asked_about_and_the_call_runs_again_only_if_not_kept(
    postgres_url: str, proxy: TcpProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A commit whose answer never came: the server may have kept it or not. Cut before it
    reached the server, the call runs again; cut after (the server committed, its answer
    lost), the call returns. Each event is stored once (a blind retry stored it twice, and
    failing instead stopped the coordinator: a run cut at such a moment was lost)."""
    with open_store(_through(postgres_url, proxy), tmp_path, outage_wait=60) as store:
        store.create_run("out-5", {"model": "cnn"}, seed=0)
        fired = _cut_at(store.engine, proxy, "commit", lambda _: True)
        assert store.get_run("out-5").run_id == "out-5"  # a read: lost nothing either way
        assert fired
        time.sleep(1.5)  # the proxy is back
        fired = _cut_at(store.engine, proxy, "commit", lambda _: True)
        store.outages()  # the read's, taken
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="storage.outage"):
            store.add_event("out-5", Event("note", "cut before its commit"))
        assert fired and "was not kept (aborted): its call runs again" in caplog.text
        # one outage: running the call again once the server said so is not a second one
        assert caplog.text.count("does not answer") == 1 and len(store.outages()) == 1
        time.sleep(1.5)
        kept: list[bool] = []

        def after_commit_is_sent(_connection: object) -> None:
            if not kept:
                kept.append(True)
                proxy.cut_after_next_request()
                threading.Timer(1.0, proxy.restore).start()

        event.listen(store.engine, "commit", after_commit_is_sent)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="storage.outage"):
            store.add_event("out-5", Event("note", "cut after its commit"))
        assert kept and "answer was lost was kept by the server" in caplog.text
    with open_store(postgres_url, tmp_path) as direct:
        notes = [e.detail for e in direct.events("out-5")]
    assert notes == ["cut before its commit", "cut after its commit"], notes


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
        outages = [e for e in monitor.events("svc-1") if e.kind == "database-outage"]
        # stamped with the round whose bookkeeping waited: round 1's, when the cut came right
        # after its commit, or a later one
        assert len(outages) == 1 and outages[0].round in (1, 2, 3), outages  # in the history
        assert "did not answer for" in outages[0].detail
    said = [r.getMessage() for r in caplog.records]
    assert any("answers again after" in m for m in said), said


def test_a_coordinator_waits_for_a_database_that_does_not_answer_yet(
    postgres_url: str, proxy: TcpProxy, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Started while the server was down (a host rebooting, a failover), it exited 3 at
    once: a service manager's few restarts could all be spent in the gap. A server that
    answers with a refusal (a role it does not know) is not waited for."""
    url = _through(postgres_url, proxy)
    timer = _cut_for(proxy, 2.0)
    began = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="storage.outage"):
        open_store(url, tmp_path, outage_wait=30).close()
    timer.join()
    assert time.monotonic() - began >= 1.5
    assert "waiting up to 30 s for it (--db-outage-wait)" in caplog.text
    assert "answers again after" in caplog.text
    stranger = make_url(url).set(username="edgesplit_no_such_role")
    began = time.monotonic()
    with pytest.raises(StoreError, match="edgesplit_no_such_role"):
        open_store(stranger.render_as_string(hide_password=False), tmp_path, outage_wait=30)
    assert time.monotonic() - began < 10, "a refusal is not an outage"
    proxy.cut()
    with pytest.raises(UnreachableError, match="is the database server running"):
        open_store(url, tmp_path, outage_wait=1.0)


@contextlib.contextmanager
def _cut_and_interrupted(monitor: RunStore, proxy: TcpProxy) -> Iterator[list[float]]:
    """Once the run has committed round 1: cut the database for good and, a second later,
    raise KeyboardInterrupt in the main thread (SIGUSR1), as a SIGTERM would. A signal after
    the block is ignored, never left to the default action (which would end the worker)."""
    ended, signalled = threading.Event(), []

    def interrupt(_signum: int, _frame: object) -> None:
        if not ended.is_set():
            raise KeyboardInterrupt

    def cut_and_stop() -> None:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and not ended.is_set():
            try:
                if (monitor.get_run("svc-1").current_round or 0) >= 1:
                    break
            except StoreError:  # the run is not created yet
                pass
            time.sleep(0.05)
        if ended.is_set():
            return
        proxy.cut()  # and never back
        if not ended.wait(1.0):
            signalled.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    stopper = threading.Thread(target=cut_and_stop, daemon=True)
    stopper.start()
    try:
        yield signalled
    finally:
        ended.set()
        stopper.join(5)
        signal.signal(signal.SIGUSR1, previous)


def test_a_stop_in_an_outage_is_at_once_and_the_run_resumes_later(
    postgres_url: str, proxy: TcpProxy, tmp_path: Path, profile: ModelProfile
) -> None:
    """SIGTERM while the database was down: recording the stop waited the whole outage wait
    (and releasing the lease another), then exited 3: 250 s, not 143 at once."""
    from coordinator.errors import RunCancelled

    run = config(tmp_path, rounds=3)
    hub = InProcessHub()
    start_fleet(hub, tmp_path, dict.fromkeys(EDGES, 1 << 30), {})
    monitor = open_store(postgres_url, tmp_path / "checkpoints")
    store = open_store(_through(postgres_url, proxy), tmp_path / "checkpoints", outage_wait=60)
    with _cut_and_interrupted(monitor, proxy) as signalled, store, monitor:
        coordinator = Coordinator(run, store, hub.connect("coordinator"), profile=lambda _: profile)
        with pytest.raises(RunCancelled):
            coordinator.run()
        stopped = time.monotonic() - signalled[0]
        assert stopped < 20, f"stopped {stopped:.0f} s after the signal, on a 60 s wait"
        record = monitor.get_run("svc-1")
        assert record.status == "training" and record.current_round in (1, 2)
