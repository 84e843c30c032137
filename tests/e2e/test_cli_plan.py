"""``edgesplit plan`` as a user runs it: a separate process, real files, exit codes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.e2e.cli import ROOT
from tests.e2e.cli import run_cli as run

pytestmark = pytest.mark.e2e

EXAMPLE = ROOT / "coordinator" / "examples" / "devices.yaml"


def test_plan_json_has_the_contract_fields() -> None:
    done = run("plan", "--model", "cnn", "--devices", str(EXAMPLE), "--batch-size", "32", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["model"] == "cnn" and plan["num_blocks"] == 6 and plan["batch_size"] == 32
    assert plan["estimated_step_seconds"] > 0
    names = [edge["name"] for edge in plan["edges"]]
    assert names == ["pi-01", "pi-02", "jetson-01"]
    for edge in plan["edges"]:
        assert set(edge) >= {
            "name",
            "blocks",
            "estimated_peak_bytes",
            "budget_bytes",
            "cut_bytes_per_sample",
            "flops_per_sample",
        }
        assert edge["blocks"][0] == 0 and edge["estimated_peak_bytes"] <= edge["budget_bytes"]
    splits = {edge["blocks"][1] for edge in plan["edges"]}
    assert len(splits) >= 2, "devices of different memory should get different split points"
    (server,) = plan["servers"]
    assert server["name"] == "gpu-a" and server["blocks"] == [min(splits), 6]


def test_uniform_cuts_put_every_edge_at_one_cut() -> None:
    done = run("plan", "--model", "cnn", "--devices", str(EXAMPLE), "--cuts", "uniform", "--json")
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    free = json.loads(run("plan", "--model", "cnn", "--devices", str(EXAMPLE), "--json").stdout)
    assert len({tuple(edge["blocks"]) for edge in plan["edges"]}) == 1
    assert plan["estimated_step_seconds"] >= free["estimated_step_seconds"]


def test_plan_table_is_readable() -> None:
    done = run("plan", "--model", "mlp", "--devices", str(EXAMPLE), "--input-shape", "1,8,8")
    assert done.returncode == 0, done.stderr
    assert "jetson-01" in done.stdout and "estimated step time" in done.stdout


def test_infeasible_plan_exits_2_naming_the_device(tmp_path: Path) -> None:
    devices = tmp_path / "devices.yaml"
    devices.write_text(
        "devices:\n"
        "  - {name: tiny-01, kind: edge, memory: 1MiB, flops: 1e9, uplink: 1Mbit}\n"
        "  - {name: gpu-a, kind: gpu, memory: 8GiB, flops: 1e13}\n"
    )
    done = run("plan", "--model", "cnn", "--devices", str(devices))
    assert done.returncode == 2
    assert "tiny-01" in done.stderr and "lower the batch size" in done.stderr
    assert done.stdout == ""

    # beside an edge that fits, it is left out, as the coordinator leaves it out
    roomy = "  - {name: pi-01, kind: edge, memory: 512MiB, flops: 1e9, uplink: 1Mbit}\n"
    devices.write_text(devices.read_text() + roomy)
    done = run("plan", "--model", "cnn", "--devices", str(devices), "--json")
    assert done.returncode == 0, done.stderr
    assert [edge["name"] for edge in json.loads(done.stdout)["edges"]] == ["pi-01"]
    assert "warning: left out of the plan, as the coordinator would: edge 'tiny-01'" in done.stderr


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            "devices:\n  - {name: a, kind: edge, memory: 1 parsec, flops: 1, uplink: 1Mbit}\n",
            "memory",
        ),
        ("devices:\n  - {name: a, kind: edge, memory: 1GiB, flops: 1}\n", "uplink"),
    ],
)
def test_bad_devices_file_exits_2(tmp_path: Path, content: str, message: str) -> None:
    devices = tmp_path / "devices.yaml"
    devices.write_text(content)
    done = run("plan", "--model", "cnn", "--devices", str(devices))
    assert done.returncode == 2 and message in done.stderr


def test_unknown_model_exits_2() -> None:
    done = run("plan", "--model", "vgg", "--devices", str(EXAMPLE))
    assert done.returncode == 2 and "neither a zoo model" in done.stderr


def test_unknown_model_in_a_simulation_is_one_plain_line(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    done = run("simulate", "--model", "vgg", "--out", str(tmp_path / "sim"), "--quiet")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (  # profiled in a fresh process; its error reads the same
        "edgesplit simulate: error: model: 'vgg' is neither a zoo model (mlp, cnn, resnet8, "
        "resnet20, resnet32, or any resnetN with N = 6n+2) nor an import path of the form "
        "'package.module:function'"
    )
