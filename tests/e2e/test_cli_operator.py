"""The operator's CLI (issue 17): exit codes and one-line errors, Ctrl-C and SIGTERM cancel a
run that the same command resumes, ``runs events`` / ``runs stop``, and ``edgesplit broker``
leaving nothing behind."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from storage import open_store
from storage.records import Event
from tests.e2e.cli import ROOT, run_cli
from wire.broker import free_port

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "coordinator" / "examples" / "run.yaml"


def _one_line_error(done: subprocess.CompletedProcess[str]) -> str:
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
    return lines[0]


def test_a_bad_config_exits_2(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text("run_id: x\nmodel: {model: mlp}\nbogus_key: 1\n")

    done = run_cli("coordinator", "--config", str(config), "--db", str(tmp_path / "db"))

    assert done.returncode == 2
    assert _one_line_error(done).startswith("edgesplit coordinator: error:")


def test_an_edge_with_no_samples_exits_2_before_it_connects(tmp_path: Path) -> None:
    """It came online and refused every assignment; a file of NaN was refused at start."""
    empty = tmp_path / "empty.npz"
    np.savez(empty, x=np.zeros((0, 1, 8, 8), np.float32), y=np.zeros(0, np.int64))
    broker = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens there: it must not get that far

    done = run_cli("edge", "--id", "pi-01", "--data", f"npz:{empty}", "--broker", broker)

    assert done.returncode == 2, done.stderr
    assert _one_line_error(done).endswith(f"--data npz:{empty}: it holds no samples")


@pytest.mark.parametrize(
    ("role", "model", "named"),
    [
        ("edge", "nosuch:fn", "cannot import module 'nosuch'"),
        ("edge", "json:nosuch", "'json' has no callable named 'nosuch'"),
        ("gpu-server", "cnnn", "is neither a zoo model"),
    ],
)
def test_an_agent_given_a_model_it_cannot_build_exits_2_before_it_connects(
    role: str, model: str, named: str
) -> None:
    broker = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens there: it must not get that far
    data = ("--data", "digits") if role == "edge" else ()
    done = run_cli(role, "--id", "pi-01", *data, "--model", model, "--broker", broker)
    assert done.returncode == 2, done.stderr
    assert f"--model {model}: " in _one_line_error(done) and named in done.stderr, done.stderr


def test_an_unreachable_broker_exits_3(tmp_path: Path) -> None:
    broker = f"mqtt://127.0.0.1:{free_port()}"  # nothing listens there

    done = run_cli(
        "coordinator", "--config", str(EXAMPLE), "--db", str(tmp_path / "r.db"), "--broker", broker
    )

    assert done.returncode == 3, done.stderr
    line = _one_line_error(done)
    assert "unreachable" in line and "MQTT broker at 127.0.0.1" in line and "is it running" in line


def test_an_unreachable_database_exits_3() -> None:
    pytest.importorskip("psycopg")
    url = f"postgresql+psycopg://nobody:secret@127.0.0.1:{free_port()}/runs"

    done = run_cli("status", "--db", url)

    assert done.returncode == 3, done.stderr
    line = _one_line_error(done)
    assert "cannot open the database" in line and "secret" not in line


def test_a_missing_ca_file_is_named(tmp_path: Path) -> None:
    ca = tmp_path / "missing-ca.pem"

    done = run_cli("coordinator", "--config", str(EXAMPLE), "--broker", f"mqtts://h:8883?ca={ca}")

    assert done.returncode == 2
    assert str(ca) in _one_line_error(done)


def _start_simulation(out: Path, rounds: int) -> subprocess.Popen[str]:
    args = ["simulate", "--out", str(out), "--quiet", "--clients", "2", "--rounds", str(rounds)]
    return subprocess.Popen(
        [sys.executable, "-m", "edgesplit", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_round(out: Path, process: subprocess.Popen[str], timeout: float = 240) -> str:
    """The simulation's run id, once its first round is committed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        if (out / "runs.db").exists():
            with open_store(f"sqlite:///{out / 'runs.db'}") as store:
                runs = store.list_runs()
            if runs and runs[0].current_round:
                return runs[0].run_id
        time.sleep(0.5)
    process.kill()
    raise AssertionError(f"no round committed: {process.communicate()[1][-2000:]}")


def _run(out: Path, run_id: str) -> tuple[str, int | None]:
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        run = store.get_run(run_id)
    return run.status, run.current_round


def test_ctrl_c_cancels_a_simulation_and_the_same_command_resumes_it(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    out = tmp_path / "sim"
    process = _start_simulation(out, rounds=50)
    run_id = _wait_for_round(out, process)

    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)

    assert process.returncode == 130, stderr
    assert "Traceback" not in stderr, stderr
    # the last line says what happened (agents may log that they gave up the round before it)
    assert stderr.strip().splitlines()[-1] == (
        f"edgesplit simulate: run {run_id} cancelled (interrupted by SIGINT); run the same "
        "command again to resume"
    )
    status, done = _run(out, run_id)
    assert status == "cancelled" and done is not None
    # the same command (fewer rounds: a change a resume allows) resumes the run and finishes
    again = run_cli(
        "simulate", "--out", str(out), "--quiet", "--clients", "2", "--rounds", str(done + 1)
    )
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "summary.json").read_text())["run_id"] == run_id
    assert _run(out, run_id) == ("finished", done + 1)
    events = run_cli("runs", "events", run_id, "--db", str(out / "runs.db"), "--json")
    kinds = [json.loads(line)["kind"] for line in events.stdout.splitlines()]
    assert kinds[-2:] == ["cancelled", "resumed"], kinds


def test_runs_stop_stops_a_running_coordinator(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    out = tmp_path / "sim"
    process = _start_simulation(out, rounds=50)
    run_id = _wait_for_round(out, process)

    stopped = run_cli("runs", "stop", run_id, "--db", str(out / "runs.db"), timeout=120)

    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == f"run {run_id} is cancelled by its coordinator"
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr, stderr
    assert "stop requested" in stderr.splitlines()[-1]
    assert _run(out, run_id)[0] == "cancelled"
    events = run_cli("runs", "events", run_id, "--db", str(out / "runs.db"))
    assert events.returncode == 0
    kinds = [line.split("  ")[1] for line in events.stdout.splitlines()]
    assert kinds[-3:] == ["stop-requested", "stopping", "cancelled"], events.stdout
    assert "stop requested by edgesplit runs stop" in events.stdout.splitlines()[-1]


def test_runs_stop_cancels_a_run_nothing_drives_and_status_shows_why(tmp_path: Path) -> None:
    db = tmp_path / "runs.db"
    with open_store(f"sqlite:///{db}") as store:
        store.create_run("orphan", {}, 0)
        store.set_run_status("orphan", "training")  # its coordinator was killed
        store.add_event("orphan", Event("round-failed", "edge-1 offline", round=1))

    stopped = run_cli("runs", "stop", "orphan", "--db", str(db))
    status = run_cli("status", "--db", str(db), "--run", "orphan")
    unknown = run_cli("runs", "events", "nope", "--db", str(db))

    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == "run orphan is cancelled (no coordinator was driving it)"
    assert status.stdout.startswith("run orphan: cancelled")
    assert "round-failed  round 1  edge-1 offline" in status.stdout
    assert "no coordinator held the run" in status.stdout.splitlines()[-1]
    assert unknown.returncode == 2 and "'nope' is not in this store" in unknown.stderr


NEEDS_MOSQUITTO = pytest.mark.skipif(
    shutil.which("mosquitto") is None and not Path("/usr/sbin/mosquitto").exists(),
    reason="needs mosquitto",
)


def _stopped_broker(stop: Callable[[subprocess.Popen[str]], None], what: str) -> None:
    """Start `edgesplit broker` as a shell would (the thread limits this suite sets left out,
    so numpy's BLAS starts its thread), ``stop`` it; it must exit 0 with mosquitto and its
    folder gone."""
    limits = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "GOTO_NUM_THREADS")
    env = {k: v for k, v in os.environ.items() if k not in limits}
    process = subprocess.Popen(
        [sys.executable, "-m", "edgesplit", "broker", "--port", str(free_port())],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env | {"PYTHONFAULTHANDLER": "1"},  # SIGABRT dumps every thread's stack
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    folder = Path(line.split("(config ")[1].split(")")[0]).parent
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children").read_text().split()
    assert folder.is_dir() and len(children) == 1, (line, children)

    stop(process)
    try:
        process.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # say where it hangs
        process.send_signal(signal.SIGABRT)
        _, stacks = process.communicate(timeout=30)
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(children[0]), signal.SIGKILL)
        shutil.rmtree(folder, ignore_errors=True)
        pytest.fail(f"no exit 30 s after {what}; its threads:\n{stacks}")

    assert process.returncode == 0
    assert not folder.exists()
    with pytest.raises(ProcessLookupError):
        os.kill(int(children[0]), 0)


@NEEDS_MOSQUITTO
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_broker_leaves_no_process_or_folder_behind(signum: int) -> None:
    _stopped_broker(lambda process: process.send_signal(signum), signal.Signals(signum).name)


@NEEDS_MOSQUITTO
@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), "tgkill"), reason="needs Linux's tgkill")
def test_broker_stops_on_a_sigterm_that_another_of_its_threads_receives() -> None:
    # The kernel may hand a process its SIGTERM on any thread (numpy's BLAS starts one). A
    # wait blocked in the main thread's waitpid was then not interrupted and Python never ran
    # the handler: `edgesplit broker` hung (CI, once). Sent here to that thread on purpose.
    def to_another_thread(process: subprocess.Popen[str]) -> None:
        others = [int(t) for t in os.listdir(f"/proc/{process.pid}/task") if int(t) != process.pid]
        if not others:
            process.kill()
            pytest.skip("`edgesplit broker` runs a single thread here")
        assert ctypes.CDLL(None).tgkill(process.pid, others[0], signal.SIGTERM) == 0

    _stopped_broker(to_another_thread, "a SIGTERM to a thread other than the main one")
