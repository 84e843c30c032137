"""``edgesplit export`` on a run stored in SQLite: the model and each device's segment."""

from __future__ import annotations

from pathlib import Path

import pytest

from coordinator.config import RunConfig
from coordinator.partitioner import PartitionConfig, Problem, plan_split
from split_models import Segment, build_model, profile_model
from split_models.devices import DeviceSpec
from split_models.weights import segment_state
from storage import open_store
from tests.e2e.cli import run_cli as run

pytestmark = pytest.mark.e2e


def _stored_run(database: Path) -> None:
    config = RunConfig.parse(
        {
            "run_id": "exp-1",
            "model": "cnn",
            "input_shape": [1, 8, 8],
            "num_classes": 10,
            "devices": {"edges": 2},
            "rounds": 1,
        }
    )
    model = build_model("cnn", (1, 8, 8), 10, seed=3)
    profile, partition = profile_model(model, ("linear",), 16), PartitionConfig(batch_size=16)
    # pi-01 holds block 0 and no more, whatever this process's profile measured (a fresh
    # process measures more than one that trained before: a fixed 2 MiB once did not fit)
    need = Problem.build(profile, partition).edge_memory
    devices = [
        DeviceSpec("pi-01", "edge", (need[1] + need[2]) // 2, 1e9, 1e6),
        DeviceSpec("pi-02", "edge", 64 * 2**20, 1e10, 1e7),
        DeviceSpec("gpu-a", "gpu", 2**30, 1e12),
    ]
    plan = plan_split(profile, devices, partition)
    assert plan.edge("pi-01").blocks == (0, 1)
    with open_store(str(database)) as store:
        store.create_run("exp-1", config.to_dict(), seed=0)
        store.set_plan("exp-1", plan.to_dict())
        store.open_round("exp-1", 1, ["pi-01", "pi-02"])
        whole = segment_state(Segment.from_model(model, 0, model.num_blocks))
        store.commit_round(
            "exp-1",
            1,
            {
                "front": {k: v for k, v in whole.items() if k.startswith("block0.")},
                "rest": {k: v for k, v in whole.items() if not k.startswith("block0.")},
            },
        )


def test_export_writes_checked_onnx_for_the_model_and_each_device(tmp_path: Path) -> None:
    database = tmp_path / "runs.db"
    _stored_run(database)
    done = run(
        "export",
        "--db",
        str(database),
        "--run",
        "exp-1",
        "--out",
        str(tmp_path / "onnx"),
        "--per-device",
    )
    assert done.returncode == 0, done.stderr
    files = sorted(p.name for p in (tmp_path / "onnx").glob("*.onnx"))
    assert files == [
        "exp-1-round1-model.onnx",
        "exp-1-round1-pi-01.onnx",
        "exp-1-round1-pi-02.onnx",
    ]
    assert done.stdout.count(" ok") == 3 and "max |onnx - torch|" in done.stdout
    weights = tmp_path / "onnx" / "exp-1-round1-model.safetensors"
    assert f"{weights}  the model's state dict" in done.stdout and weights.is_file()


def test_export_errors_exit_2(tmp_path: Path) -> None:
    database = tmp_path / "runs.db"
    _stored_run(database)
    unknown = run("export", "--db", str(database), "--run", "nope", "--out", str(tmp_path))
    assert unknown.returncode == 2 and "nope" in unknown.stderr
    missing = run(
        "export", "--db", str(database), "--run", "exp-1", "--round", "7", "--out", str(tmp_path)
    )
    assert missing.returncode == 2 and "round 7" in missing.stderr


def test_export_takes_the_only_run_of_a_store_and_names_them_when_there_are_more(
    tmp_path: Path,
) -> None:
    database = tmp_path / "runs.db"
    _stored_run(database)
    only = run("export", "--db", str(database), "--out", str(tmp_path / "onnx"))
    assert only.returncode == 0, only.stderr
    assert (tmp_path / "onnx" / "exp-1-round1-model.onnx").is_file()
    with open_store(str(database)) as store:  # a run that failed to start: no round
        store.create_run("exp-2", store.get_run("exp-1").config, seed=0)
    trained = run("export", "--db", str(database), "--out", str(tmp_path / "trained"))
    assert trained.returncode == 0, trained.stderr  # the only run with a round
    assert (tmp_path / "trained" / "exp-1-round1-model.onnx").is_file()
    with open_store(str(database)) as store:
        store.open_round("exp-2", 1, ["pi-01"])
        store.commit_round("exp-2", 1, store.checkpoint("exp-1", 1).weights)
    two = run("export", "--db", str(database), "--out", str(tmp_path / "again"))
    assert two.returncode == 2, two.stderr
    assert "holds 2 runs with committed rounds (exp-1, exp-2); name one" in two.stderr
