"""``edgesplit simulate``: the README's main job, its outputs, and its errors."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.e2e.cli import run_cli

pytestmark = pytest.mark.e2e


def test_default_simulation_trains_and_writes_its_outputs(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    out = tmp_path / "sim"
    done = run_cli("simulate", "--out", str(out), "--quiet")
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "local-loss"
    assert [r["round"] for r in summary["rounds"]] == [1, 2, 3]
    # digits held out (25%): chance is 0.1; the runs measured 0.93-0.94 after 3 rounds
    assert summary["final_accuracy"] >= 0.8, summary["rounds"]
    assert summary["rounds"][-1]["accuracy"] > summary["rounds"][0]["accuracy"] - 0.02
    clients = summary["clients"]
    assert len(clients) == 4
    for client in clients:
        assert client["estimated_peak_bytes"] <= client["budget_bytes"]
        assert client["examples"] > 0 and client["bytes_up"] > 0
        # measured in a fresh process per assignment: real, and under the device's budget
        assert 0 < client["measured_peak_bytes"] <= client["budget_bytes"]
        # local-loss: activations and labels go up, no gradient comes down
        assert 0 < client["cut_bytes_up"] < client["bytes_up"]
        assert client["cut_bytes_down"] == 0
    assert summary["total_simulated_seconds"] > 0
    assert 0 < summary["training_wall_seconds"] < summary["total_wall_seconds"]
    with (out / "rounds.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 3
    assert "plan for cnn" in (out / "plan.txt").read_text()
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "final accuracy" in done.stdout
    status = run_cli("status", "--db", str(out / "runs.db"), "--run", summary["run_id"], "--json")
    stored = json.loads(status.stdout)
    assert stored["status"] == "finished"
    assert stored["events"]["simulation"] == 1 and stored["events"]["planned"] == 1, stored
    plain = run_cli("status", "--db", str(out / "runs.db"), "--run", summary["run_id"])
    assert "events: model-code 1, simulation 1, " in plain.stdout, plain.stdout  # finished too
    # status and summary.json count the same clients and examples; the GPU server apart
    trained = sum(c["examples"] for c in clients)
    assert sum(r["examples"] for r in stored["rounds"]) == trained
    for row, record in zip(summary["rounds"], stored["rounds"], strict=True):
        assert row["participants"] == len(record["participants"]) == 4, (row, record)
        assert record["servers"] == ["gpu-sim"] and record["server_examples"] == record["examples"]


def test_splitfed_over_an_embedded_broker(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    out = tmp_path / "sim"
    done = run_cli(
        "simulate",
        "--out",
        str(out),
        "--method",
        "splitfed",
        "--broker",
        "embedded",
        "--clients",
        "2",
        "--rounds",
        "1",
        "--quiet",
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "splitfed" and summary["final_accuracy"] > 0.3
    # gradients come back in splitfed, one per batch, as large as the activations that went up
    for client in summary["clients"]:
        assert client["cut_bytes_down"] > 0.9 * client["cut_bytes_up"] > 0
        assert client["bytes_down"] > client["cut_bytes_down"]


@pytest.mark.parametrize(
    ("config", "args", "message"),
    [
        ("rounds: 2\nwings: 3\n", (), "unknown key(s) ['wings']"),
        ("method: bogus\n", (), "'bogus' is not one of"),
        ("devices: [{memory: 1MiB, flops: 1e9, share: 0.5}]\n", (), "shares must add up to 1"),
        ("input_shape: [1, 28, 28]\n", (), "the data has samples of shape [1, 8, 8]"),
        ("availability: {online: 1.5}\n", (), "availability.online: expected a fraction"),
        ("availability: {offline: {pi: [1]}}\n", (), "'pi' is not a client"),
        ("availability: {offline: {client-001: [9]}}\n", (), "expected a list of rounds in 1..3"),
        ("workers: 0\n", (), "workers: expected an integer >= 1"),
        ("batched: 3\n", (), "batched: expected true or false"),
        ("client_device: tpu\n", (), "client_device: expected cpu, cuda"),
        ("gpu: {device: 'cuda:99'}\n", (), "gpu.device: cuda:99, but torch sees"),
    ],
)
def test_bad_simulation_configs_are_rejected_by_name(
    tmp_path: Path, config: str, args: tuple[str, ...], message: str
) -> None:
    path = tmp_path / "sim.yaml"
    path.write_text(config)
    done = run_cli("simulate", "--config", str(path), "--out", str(tmp_path / "o"), *args)
    assert done.returncode == 2
    assert message in done.stderr, done.stderr


def test_the_config_may_be_named_without_the_flag(tmp_path: Path) -> None:
    path, other = tmp_path / "sim.yaml", tmp_path / "other.yaml"
    path.write_text("rounds: 2\nwings: 3\n")  # read: refused by name, before any training
    other.write_text("rounds: 2\n")
    done = run_cli("simulate", str(path), "--out", str(tmp_path / "o"))
    assert done.returncode == 2 and "unknown key(s) ['wings']" in done.stderr, done.stderr
    both = run_cli("simulate", str(other), "--config", str(path), "--out", str(tmp_path / "o"))
    assert both.returncode == 2 and "two configs given" in both.stderr, both.stderr


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ("ids", "data: its token ids span [1, 70], outside the model's input_range [0, 64)"),
        ("empty", "data: it holds no samples"),
        ("cut", "not an npz archive"),
    ],
)
def test_data_the_model_cannot_take_is_refused_before_training(
    tmp_path: Path, data: str, message: str
) -> None:
    # a token id past the vocabulary used to fail one client's round mid-way, and the round
    # then waited for that client until its deadline
    x = (np.arange(40 * 8).reshape(40, 8) % 63 + 1).astype(np.int64)
    if data == "ids":
        x[0, 0] = 70
    if data == "empty":
        x = x[:0]
    np.savez(tmp_path / "tokens.npz", x=x, y=np.arange(len(x)) % 4)
    if data == "cut":
        whole = (tmp_path / "tokens.npz").read_bytes()
        (tmp_path / "tokens.npz").write_bytes(whole[:200])
    config = tmp_path / "sim.yaml"
    config.write_text(
        "model: tests.fixtures.gallery:lstm_classifier\ninput_shape: [8]\ninput_dtype: int64\n"
        f"input_range: 64\nnum_classes: 4\ndata: npz:{tmp_path / 'tokens.npz'}\nclients: 2\n"
    )
    done = run_cli("simulate", "--config", str(config), "--out", str(tmp_path / "o"), "-q")
    assert done.returncode == 2, done.stderr
    assert message in done.stderr, done.stderr


@pytest.mark.parametrize("method", ["centralized", "fedavg"])
def test_baselines_run_in_the_same_harness(tmp_path: Path, method: str) -> None:
    pytest.importorskip("sklearn")
    out = tmp_path / "sim"
    done = run_cli("simulate", "--out", str(out), "--method", method, "--rounds", "2", "-q")
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == method and len(summary["rounds"]) == 2
    assert summary["final_accuracy"] >= 0.8, summary["rounds"]
    if method == "fedavg":
        assert len(summary["clients"]) == 4
        assert all(c["blocks"][0] == 0 and c["fits"] for c in summary["clients"])
        assert summary["rounds"][0]["bytes_up"] > 0
    else:
        assert summary["clients"] == []
    status = run_cli("status", "--db", str(out / "runs.db"), "--run", summary["run_id"], "--json")
    assert json.loads(status.stdout)["status"] == "finished"


def test_fedavg_flags_clients_the_whole_model_does_not_fit(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    config = tmp_path / "sim.yaml"
    config.write_text(
        "devices:\n"
        "  - {profile: tiny, share: 0.5, memory: 1MiB, flops: 1e9, uplink: 10Mbit}\n"
        "  - {profile: big, share: 0.5, memory: 1GiB, flops: 1e11, uplink: 100Mbit}\n"
        "rounds: 1\n"
    )
    out = tmp_path / "sim"
    done = run_cli("simulate", "--config", str(config), "--out", str(out), "--method", "fedavg")
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    fits = {c["name"]: c["fits"] for c in summary["clients"]}
    assert fits == {
        "client-000": False,
        "client-001": False,
        "client-002": True,
        "client-003": True,
    }
    assert "does not fit client-000, client-001" in (out / "plan.txt").read_text()
    assert "does not fit its budget" in done.stdout
    # the whole model trained on every client: no device segments to export, said up front
    onnx = tmp_path / "onnx"
    export = run_cli("export", "--db", str(out / "runs.db"), "--out", str(onnx), "--per-device")
    assert export.returncode == 2, export.stderr
    assert "--per-device: run" in export.stderr and "export without it" in export.stderr
    assert not onnx.exists() or not any(onnx.iterdir()), "nothing written before the refusal"


@pytest.mark.parametrize("transport", ["in-process", "mqtt"])
def test_clients_offline_by_the_trace_sit_out_their_rounds(
    tmp_path: Path, transport: str, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("sklearn")
    # over MQTT a client going offline drops its connection and the broker publishes its will
    broker = request.getfixturevalue("broker").url if transport == "mqtt" else "none"
    config = tmp_path / "sim.yaml"
    config.write_text(
        "rounds: 3\nworkers: 1\nmeasure_memory: false\nfederated_eval: 0.2\n"
        "availability: {offline: {client-001: [2], client-003: [2, 3]}}\n"
    )
    out = tmp_path / "sim"
    done = run_cli("simulate", "--config", str(config), "--out", str(out), "--broker", broker)
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [r["participants"] for r in summary["rounds"]] == [4, 2, 3]
    trained = {c["name"]: c["rounds_trained"] for c in summary["clients"]}
    assert trained == {"client-000": 3, "client-001": 2, "client-002": 3, "client-003": 1}
    assert all(c["measured_peak_bytes"] is None for c in summary["clients"])
    # the clients that trained evaluated the assembled model on the fifth they hold out
    assert all(0 < r["federated_accuracy"] <= 1 for r in summary["rounds"])
    # without a terminal the progress display prints one line per committed round
    assert "round 2/3: accuracy" in done.stderr
    assert summary["final_accuracy"] >= 0.8, summary["rounds"]


def test_batched_clients_train_together_and_still_learn(tmp_path: Path) -> None:
    pytest.importorskip("sklearn")
    out = tmp_path / "sim"
    done = run_cli("simulate", "--out", str(out), "--batched", "--rounds", "2", "-q")
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    counts = summary["batched"]
    # every client step ran exactly once, and stacked calls served several clients at a time
    batches = sum(
        c["rounds_trained"] * math.ceil(c["examples"] / c["rounds_trained"] / 32)
        for c in summary["clients"]
    )
    assert counts["client_steps"] == batches
    assert counts["calls"] < counts["client_steps"]
    assert summary["final_accuracy"] >= 0.8, summary["rounds"]


def test_a_users_own_module_and_data_beside_the_config_file(tmp_path: Path) -> None:
    # an ordinary nn.Module with its own forward, in a file next to SIM.yaml; data given
    # relative to that file; the command runs from elsewhere (the repository root)
    project = tmp_path / "project"
    (project / "data").mkdir(parents=True)
    (project / "mynets.py").write_text(
        "import torch.nn.functional as F\n"
        "from torch import nn\n\n"
        "class Net(nn.Module):\n"
        "    def __init__(self, classes):\n"
        "        super().__init__()\n"
        "        self.conv = nn.Conv2d(1, 8, 3, padding=1)\n"
        "        self.mid = nn.Linear(8 * 16, 32)\n"
        "        self.out = nn.Linear(32, classes)\n\n"
        "    def forward(self, x):\n"
        "        x = F.max_pool2d(F.relu(self.conv(x)), 2)\n"
        "        return self.out(F.relu(self.mid(x.flatten(1))))\n\n"
        "def net(num_classes):\n"
        "    return Net(num_classes)\n"
    )
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 4, 160)
    images = rng.normal(0, 1, (160, 1, 8, 8)).astype(np.float32) + labels[:, None, None, None]
    np.savez(project / "data" / "train.npz", x=images, y=labels)
    (project / "SIM.yaml").write_text(
        "model: mynets:net\ninput_shape: [1, 8, 8]\nnum_classes: 4\n"
        "data: npz:data/train.npz\nclients: 2\nrounds: 1\nmeasure_memory: false\n"
    )
    out = tmp_path / "out"
    done = run_cli("simulate", "--config", str(project / "SIM.yaml"), "--out", str(out), "-q")
    assert done.returncode == 0, done.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["rounds"][0]["round"] == 1
    assert "plan for mynets:net (3 blocks)" in (out / "plan.txt").read_text()
