"""``edgesplit status --run``'s plan line, from whatever the store holds."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.store_commands import _plan_line

pytestmark = pytest.mark.unit


def test_a_large_fleet_is_counted_per_cut_and_a_malformed_plan_shows_nothing() -> None:
    edges = [{"name": f"c-{i:03d}", "blocks": [0, 2 if i % 4 else 5]} for i in range(20)]
    plan = {"edges": edges, "servers": [{"name": "gpu-a", "blocks": [2, 6]}], "cuts": "uniform"}
    assert (
        _plan_line(plan) == "cuts {2: '15 edges', 5: '5 edges'} (uniform); GPU servers gpu-a [2, 6)"
    )
    for broken in (None, {}, {"edges": [{"name": "x"}], "servers": []}, {"edges": 3}):
        assert _plan_line(broken) is None


def test_a_rounds_counts_are_of_edges_as_its_participants_are() -> None:
    """A round read '4 participants, 3 failed' of four edges: the failed GPU servers were
    counted among the edges' failures. The traffic is the edges' too, the servers' apart."""
    from storage.records import DeviceResult, RoundRecord
    from storage.report import round_summary

    record = RoundRecord(
        "r",
        4,
        "committed",
        ("pi-01", "pi-02", "gpu-a"),
        (
            DeviceResult("pi-01", examples=32, bytes_sent=300, bytes_received=20),
            DeviceResult("pi-02", examples=32, bytes_sent=300, bytes_received=20),
            DeviceResult("pi-03", failure="offline"),
            DeviceResult("gpu-a", examples=64, bytes_sent=50, bytes_received=640),
            DeviceResult("gpu-b", failure="offline"),
        ),
    )
    summary = round_summary(record, servers={"gpu-a", "gpu-b"})
    assert summary["participants"] == ["pi-01", "pi-02"] and summary["failed"] == ["pi-03"]
    assert summary["servers"] == ["gpu-a"] and summary["servers_failed"] == ["gpu-b"]
    assert summary["examples"] == 64 and summary["server_examples"] == 64
    # the edges' links, and the server's traffic (the same activations again) apart
    assert (summary["bytes_up"], summary["bytes_down"]) == (600, 40)
    assert (summary["server_bytes_up"], summary["server_bytes_down"]) == (50, 640)


def test_an_export_whose_file_fails_the_check_says_so_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """It exited 1 with nothing on stderr: a script saw only the exit code."""
    import argparse

    from coordinator import export, store_commands
    from storage import open_store

    with open_store(str(tmp_path / "runs.db")) as store:
        store.create_run("r", {}, seed=0)
    results = [
        export.ExportResult("model", (0, 6), tmp_path / "r-model.onnx", 2e-6, "dynamo"),
        export.ExportResult("pi-01", (0, 2), tmp_path / "r-pi-01.onnx", 0.62, "torchscript"),
    ]
    monkeypatch.setattr(export, "export_run", lambda *_args: results)
    args = argparse.Namespace(
        db=str(tmp_path / "runs.db"), db_password=None, checkpoints=None, run="r",
        out=str(tmp_path), round=None, per_device=True, allow_model_change=False,
    )  # fmt: skip

    assert store_commands.export_command(args) == 1
    out, err = capsys.readouterr()
    assert "r-pi-01.onnx" in out and "FAILS" in out
    assert err.startswith("edgesplit export: error: 1 of 2 file(s) compute other outputs")
    assert "r-pi-01.onnx" in err and "r-model.onnx" not in err


def test_a_failed_gpu_server_shows_in_the_status_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Failed servers were moved out of ``failed`` (edges only) into ``servers_failed``,
    which the table never showed: a round whose server was lost read as all well."""
    import argparse

    import numpy as np

    from coordinator import store_commands
    from storage import open_store
    from storage.records import DeviceResult

    with open_store(str(tmp_path / "runs.db")) as store:
        store.create_run("r", {}, seed=0)
        store.set_plan("r", {"edges": [], "servers": [{"name": "gpu-b", "blocks": [2, 6]}]})
        store.open_round("r", 1, ["pi-01", "gpu-b"])
        results = [DeviceResult("pi-01", examples=32), DeviceResult("gpu-b", failure="offline")]
        store.record_results("r", 1, results)
        store.commit_round("r", 1, {"global": {"w": np.zeros(2, np.float32)}})
    args = argparse.Namespace(
        db=str(tmp_path / "runs.db"), db_password=None, checkpoints=None, run="r", json=False
    )
    assert store_commands.status_command(args) == 0
    header, row = capsys.readouterr().out.splitlines()[-2:]
    assert header.split()[-1] == "servers_failed" and row.split()[-1] == "1", (header, row)


def test_a_splitfed_plan_says_so_in_its_header() -> None:
    """Its header said "local loss linear", which a splitfed edge does not train."""
    from coordinator.partitioner import PartitionConfig, plan_split
    from split_models.config import ModelConfig
    from split_models.devices import DeviceSpec
    from split_models.isolated import profile_in_fresh_process
    from split_models.plan import Plan

    profile = profile_in_fresh_process(ModelConfig("cnn", (1, 8, 8), 10), ("linear",), 16)
    devices = [DeviceSpec("pi-01", "edge", 1 << 30, 1e9), DeviceSpec("gpu-a", "gpu", 1 << 30, 1e12)]
    for mode, said in (("backprop", "splitfed (backprop"), ("local-loss", "local loss linear")):
        plan = plan_split(profile, devices, PartitionConfig(batch_size=16, mode=mode))
        assert said in str(plan).splitlines()[0], str(plan)
        assert Plan.from_dict(plan.to_dict()).mode == mode
    older = {k: v for k, v in plan.to_dict().items() if k != "mode"}  # stored before the field
    assert Plan.from_dict(older).mode == "local-loss"


def test_a_round_an_ended_run_never_committed_is_abandoned_not_open() -> None:
    """A run interrupted in round 3 and then ended at 2 rounds showed round 3 'open' in a
    'finished' run; a run with no committed round showed its checkpoint 'ok'."""
    import numpy as np

    from storage import open_store
    from storage.report import run_status, runs_overview

    with open_store("memory://") as store:
        store.create_run("r", {}, seed=0)
        store.set_run_status("r", "training")
        assert runs_overview(store)[0]["checkpoint"] == "none"
        for number in (1, 2):
            store.open_round("r", number, ["pi-01"])
        store.commit_round("r", 1, {"model": {"w": np.zeros(2, np.float32)}})
        assert [r["state"] for r in run_status(store, "r")["rounds"]] == ["committed", "open"]
        assert runs_overview(store)[0]["checkpoint"] == "ok"
        for ended in ("finished", "cancelled", "failed"):
            store.set_run_status("r", ended)
            states = [r["state"] for r in run_status(store, "r")["rounds"]]
            assert states == ["committed", "abandoned"], ended
