"""The same ``edgesplit simulate`` run again resumes a cancelled run only when it would train
as that run did: the same settings, data, partition and devices (the run config holds the
settings; the simulation records digests of the rest), and rounds that do not end before
those already committed (simulations on the bundled digits, in-process, SQLite file)."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from edgesplit.exits import Signalled, signals_interrupt
from simulation import simulator
from simulation.config import parse_sim_config
from simulation.simulator import simulate
from split_models.errors import ConfigError
from storage import open_store

pytestmark = pytest.mark.integration
pytest.importorskip("sklearn")


def _simulate(out: Path, allow_config_change: bool = False, **settings: Any) -> dict[str, Any]:
    base = {"rounds": 2, "clients": 2, "measure_memory": False, "workers": 1}
    config = parse_sim_config({**base, **settings})
    return simulate(config, out, allow_config_change=allow_config_change)


def _cancel(out: Path, run_id: str) -> None:
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        store.set_run_status(run_id, "cancelled")  # as Ctrl-C leaves it


def _kinds(out: Path, run_id: str) -> list[str]:
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        return [e.kind for e in store.events(run_id)]


def test_a_cancelled_run_resumes_only_on_the_same_data_partition_and_devices(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "sim"
    first = _simulate(out)["run_id"]
    assert _kinds(out, first)[:2] == ["model-code", "simulation"]
    assert "resumed" not in _kinds(out, first)
    changes = [
        ({"clients": 3}, "other partition, other devices"),
        ({"partition": {"kind": "dirichlet", "alpha": 0.5}}, "other partition"),
        ({"test_fraction": 0.3}, "other data"),
    ]
    for settings, why in changes:
        _cancel(out, first)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="simulation.resume"):
            other = _simulate(out, rounds=3, **settings)["run_id"]
        assert other != first, settings
        assert f"not resuming cancelled run {first}" in caplog.text, caplog.text
        assert why in caplog.text, caplog.text

    _cancel(out, first)
    resumed = _simulate(out, rounds=3)
    assert resumed["run_id"] == first
    assert [r["round"] for r in resumed["rounds"]] == [1, 2, 3]
    assert _kinds(out, first).count("resumed") == 1


def test_a_changed_learning_rate_resumes_only_with_allow_config_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "sim"
    first = _simulate(out)["run_id"]
    faster = {"rounds": 3, "optimizer": {"name": "adam", "lr": 0.005}}
    _cancel(out, first)
    with caplog.at_level(logging.WARNING, logger="simulation.resume"):
        other = _simulate(out, **faster)["run_id"]  # without the flag: a new run, and why
    assert other != first
    assert "optimizer.lr 0.002 -> 0.005" in caplog.text, caplog.text
    assert "--allow-config-change resumes it" in caplog.text, caplog.text

    resumed = _simulate(out, allow_config_change=True, **faster)
    assert resumed["run_id"] == first
    assert [r["round"] for r in resumed["rounds"]] == [1, 2, 3]
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        events = [e for e in store.events(first) if e.kind == "config-changed"]
        stored = store.get_run(first).config
    assert len(events) == 1 and "optimizer.lr 0.002 -> 0.005" in events[0].detail, events
    assert stored["optimizer"]["lr"] == 0.005

    _cancel(out, first)  # the flag never changes a run's network: another model starts anew
    bigger = _simulate(out, allow_config_change=True, rounds=4, model="mlp")
    assert bigger["run_id"] not in (first, other)
    _cancel(out, first)  # nor its local heads (their tensors are another shape)
    heads = _simulate(out, allow_config_change=True, rounds=4, local_loss="mlp")
    assert heads["run_id"] not in (first, other, bigger["run_id"])


def test_a_resume_that_would_end_before_the_committed_rounds_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "sim"
    run_id = _simulate(out)["run_id"]
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        store.open_round(run_id, 3, ["client-000", "client-001"])  # the try Ctrl-C cut short
    _cancel(out, run_id)
    # the least --rounds it names is one it then takes (it named 3 and took 2)
    with pytest.raises(ConfigError, match=rf"{run_id} .* has 2 rounds committed.*--rounds 2 or"):
        _simulate(out, rounds=1)
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        run = store.get_run(run_id)
    assert (run.status, run.current_round) == ("cancelled", 2)  # left as it was

    again = _simulate(out, rounds=2)  # nothing left to train: it finishes as it stands
    assert again["run_id"] == run_id and again["final_accuracy"] is not None
    assert [r["round"] for r in again["rounds"]] == [1, 2]  # not the open try of round 3


def test_labels_the_model_has_no_output_for_are_named_before_planning(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"num_classes: the data has labels up to 9, .* 5 "):
        _simulate(tmp_path / "sim", num_classes=5)
    assert not (tmp_path / "sim" / "runs.db").exists()


def test_a_run_left_training_by_a_killed_process_is_named_with_how_to_resume_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "sim"
    first = _simulate(out, rounds=1)["run_id"]
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        store.set_run_status(first, "training")  # as kill -9 leaves it
    with caplog.at_level(logging.WARNING, logger="simulation.resume"):
        second = _simulate(out, rounds=1)["run_id"]
    assert second != first
    assert f"run {first} in this --out is still marked training" in caplog.text, caplog.text
    assert f"edgesplit runs stop {first} --db" in caplog.text


def test_a_run_whose_process_is_gone_is_taken_up_by_the_same_command(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After a kill -9 the same command started a new run beside it until `runs stop`."""
    import socket
    import subprocess
    import sys

    from storage import Lease
    from storage.records import utcnow

    out = tmp_path / "sim"
    first = _simulate(out, rounds=1)["run_id"]
    killed = subprocess.Popen([sys.executable, "-c", "pass"])
    killed.wait()
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        store.set_run_status(first, "training")  # as kill -9 leaves it, its lease held
        now = utcnow()
        store.claim_lease(Lease(first, "killed", socket.gethostname(), killed.pid, 30, now, now))
    with caplog.at_level(logging.WARNING, logger="simulation.resume"):
        again = _simulate(out, rounds=2)
    assert again["run_id"] == first and [r["round"] for r in again["rounds"]] == [1, 2]
    assert f"run {first} in this --out was left training: its process is gone" in caplog.text


def test_a_finished_run_given_more_rounds_goes_on_and_given_none_a_new_run_starts(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    out = tmp_path / "sim"
    first = _simulate(out)
    with caplog.at_level(logging.WARNING, logger="simulation.resume"):
        longer = _simulate(out, rounds=3)
    assert longer["run_id"] == first["run_id"]
    assert [r["round"] for r in longer["rounds"]] == [1, 2, 3]
    assert [r["accuracy"] for r in longer["rounds"][:2]] == [
        r["accuracy"] for r in first["rounds"]
    ]  # rounds 1-2 as they were committed, not trained again
    assert f"run {first['run_id']} in this --out finished with 2 round(s) committed" in caplog.text
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        run = store.get_run(first["run_id"])
    assert (run.status, run.current_round) == ("finished", 3)

    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="simulation.resume"):
        again = _simulate(out, rounds=3)  # it has them all: a new run, said (it was silent)
    assert again["run_id"] != first["run_id"]
    assert f"run {first['run_id']} in this --out finished with 3 round(s), no fewer" in caplog.text
    assert [r["round"] for r in again["rounds"]] == [1, 2, 3]
    other = _simulate(out, rounds=4, optimizer={"name": "adam", "lr": 0.001})
    assert other["run_id"] not in (first["run_id"], again["run_id"])  # trains otherwise


def test_a_signal_after_the_last_round_still_writes_the_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "sim"
    real_rows = simulator.round_rows

    def rows_then_sigterm(*args: Any, **kwargs: Any) -> Any:
        os.kill(os.getpid(), signal.SIGTERM)  # after the run finished, before the outputs
        return real_rows(*args, **kwargs)

    monkeypatch.setattr(simulator, "round_rows", rows_then_sigterm)
    with signals_interrupt(), pytest.raises(Signalled) as stopped:
        _simulate(out)
    assert stopped.value.signum == signal.SIGTERM  # the signal still stops the command
    summary = json.loads((out / "summary.json").read_text())
    assert [r["round"] for r in summary["rounds"]] == [1, 2]
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        assert store.get_run(summary["run_id"]).status == "finished"
    assert (out / "rounds.csv").read_text().count("\n") == 3
    assert (out / "plan.txt").read_text().strip()
    assert not list(out.glob("*.tmp"))


def test_a_run_that_fails_unexpectedly_is_marked_failed_saying_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It stayed 'training' for good: a status that no coordinator would ever change."""
    from coordinator import service

    def broken(*_args: Any) -> dict[str, float]:
        raise RuntimeError("Input type (long int) and bias type (float) should be the same")

    monkeypatch.setattr(service, "evaluate_weights", broken)
    out = tmp_path / "sim"
    with pytest.raises(RuntimeError, match="bias type"):
        _simulate(out)
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        (run,) = store.list_runs()
        failed = [e.detail for e in store.events(run.run_id) if e.kind == "run-failed"]
    assert run.status == "failed"
    assert failed == [
        "unexpected RuntimeError: Input type (long int) and bias type (float) should be the same"
    ]


@pytest.mark.parametrize("method", ["fedavg", "centralized"])
def test_a_baseline_shows_its_rounds_and_an_interrupt_marks_it_cancelled(
    tmp_path: Path, method: str
) -> None:
    """A baseline showed no progress, stored no bytes down, and Ctrl-C left it 'training'
    for good (a baseline is never resumed: nothing would ever change it)."""
    from coordinator.recorder import RoundObserver

    class StopAfterFirst(RoundObserver):
        def __init__(self) -> None:
            self.committed: list[int] = []

        def round_committed(self, number: int, *_args: Any, **_kwargs: Any) -> None:
            self.committed.append(number)
            raise Signalled(signal.SIGINT)  # Ctrl-C while the first round is recorded

    out, watching = tmp_path / method, StopAfterFirst()
    config = parse_sim_config(
        {"rounds": 3, "clients": 2, "measure_memory": False, "workers": 1, "method": method}
    )
    with pytest.raises(Signalled):
        simulate(config, out, observer=watching)
    assert watching.committed == [1], "the progress display hears the baseline's rounds"
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        (run,) = store.list_runs()
        (first,) = store.list_rounds(run.run_id)
        why = [e.detail for e in store.events(run.run_id) if e.kind == "cancelled"]
    assert run.status == "cancelled" and why == ["interrupted (SIGINT)"]
    assert first.state == "committed"
    if method == "fedavg":  # each client got the whole model and sent it back
        results = [r for r in first.results if not r.failure]
        assert results and all(r.bytes_received == r.bytes_sent > 0 for r in results)


def test_changed_model_code_resumes_only_with_allow_config_change(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was an error telling `simulate` to "use a new run_id", which it has no flag for:
    code that changed now counts as the learning rate does."""
    import sys

    code = "from torch import nn\n\ndef net(input_shape, num_classes):\n    return nn.Sequential("
    layers = "nn.Flatten(), nn.Linear(64, 32), nn.{}(), nn.Linear(32, num_classes))\n"
    (tmp_path / "net_v.py").write_text(code + layers.format("ReLU"))
    monkeypatch.syspath_prepend(str(tmp_path))
    out, model = tmp_path / "sim", {"model": "net_v:net", "input_shape": [1, 8, 8]}
    first = _simulate(out, rounds=1, **model)["run_id"]
    (tmp_path / "net_v.py").write_text(code + layers.format("GELU"))
    sys.modules.pop("net_v", None)  # as a new process imports it
    with caplog.at_level(logging.WARNING, logger="simulation.resume"):
        other = _simulate(out, rounds=2, **model)["run_id"]
    assert other != first
    assert "the model's code changed" in caplog.text, caplog.text
    assert "--allow-config-change resumes it" in caplog.text, caplog.text

    resumed = _simulate(out, allow_config_change=True, rounds=2, **model)
    assert resumed["run_id"] == first and [r["round"] for r in resumed["rounds"]] == [1, 2]
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        changed = [e.detail for e in store.events(first) if e.kind == "config-changed"]
    assert len(changed) == 1 and "the model's code changed" in changed[0], changed


def test_a_stop_after_the_run_is_created_and_before_it_trains_cancels_it(
    tmp_path: Path,
) -> None:
    """A Ctrl-C while the coordinator was being set up left the run 'created' for good, with
    no event: the next command started another run beside it."""
    from simulation.config import run_config
    from simulation.resume import started_run

    run = run_config(parse_sim_config({"rounds": 1}), "early", "digits")
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        with pytest.raises(Signalled), started_run(store, run, {}):
            raise Signalled(signal.SIGINT)
        assert store.get_run("early").status == "cancelled"
        assert [e.detail for e in store.events("early") if e.kind == "cancelled"] == [
            "interrupted (SIGINT)"
        ]
