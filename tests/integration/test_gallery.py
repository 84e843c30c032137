"""The model gallery end to end: each ordinary PyTorch model (and the zoo's BatchNorm resnet8)
is planned, simulated in local-loss and splitfed mode, exported with the onnxruntime check
(whole model and each device's segment), and resumed by a restarted coordinator."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.torch import load_file

from coordinator.config import RunConfig
from coordinator.export import export_run
from coordinator.service import Coordinator
from edge_client.agent import EdgeAgent
from gpu_server.agent import GpuAgent
from simulation.baselines import model_profile
from simulation.config import parse_sim_config
from simulation.simulator import simulate
from split_models import load_dataset
from split_models.config import ModelConfig
from split_models.onnx_export import check_onnx
from split_models.zoo import build_model
from storage import open_store
from tests.fixtures import gallery
from wire.flower import node_will
from wire.roles import Announcement, node_id_for
from wire.transport import InProcessHub

pytestmark = pytest.mark.integration

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
TOKENS = {"input_dtype": "int64", "input_range": gallery.VOCAB}
MODELS: dict[str, dict[str, Any]] = {
    "lenet": {"input_shape": [1, 28, 28], "data": "mnist"},
    "resnet18_narrow": {"input_shape": [3, 16, 16], "data": "images"},
    "mobilenet_v3_small": {"input_shape": [3, 32, 32], "data": "images"},  # torchvision's
    "lstm_classifier": {"input_shape": [12], "data": "tokens", **TOKENS},
    "transformer_classifier": {"input_shape": [12], "data": "tokens", **TOKENS},
    # hidden states and the padding mask cross the cut between its encoder layers (the one cut)
    "masked_transformer": {
        "input_shape": [12],
        "data": "tokens",
        "split_points": ["layers.1"],
        **TOKENS,
    },
    "resnet8": {"input_shape": [3, 16, 16], "data": "images"},  # the zoo's, with BatchNorm
    # layers whose forward checks its input in Python and returns a tuple, kept whole
    "guarded_convnet": {"input_shape": [3, 16, 16], "data": "images"},
    "tiny_gpt": {"input_shape": [12], "data": "text", "task": "language-model", **TOKENS},
}
EDGES = ("pi-01", "pi-02")


def _model_path(name: str) -> str:
    return name if name == "resnet8" else f"tests.fixtures.gallery:{name}"


def _write_data(kind: str, shape: list[int], path: Path, count: int = 240, seed: int = 0) -> None:
    """CI-sized data with a learnable signal: MNIST digits, class-tinted images, or token
    sequences whose class is how many small ids they hold, or for the language model token
    runs that count up by a step of 1-3 (labels: the next token at every position)."""
    rng = np.random.default_rng(seed)
    if kind == "mnist":
        with np.load(FIXTURES / "tiny_mnist.npz") as archive:
            x, y = archive["x"][:count], archive["y"][:count]
    elif kind == "images":
        y = rng.integers(0, 10, count)
        tint = np.linspace(-1, 1, 10, dtype=np.float32)[y][:, None, None, None]
        x = rng.normal(0, 1, (count, *shape)).astype(np.float32) + tint
    elif kind == "tokens":
        x = rng.integers(0, gallery.VOCAB, (count, *shape))
        y = np.clip((x < gallery.VOCAB // 4).sum(axis=1) - 1, 0, 9)
    else:
        start = rng.integers(0, gallery.VOCAB, (count, 1))
        step = rng.integers(1, 4, (count, 1))
        runs = (start + step * np.arange(shape[0] + 1)) % gallery.VOCAB
        x, y = runs[:, :-1], runs[:, 1:]
    np.savez(path, x=x, y=y)


def _classes(name: str) -> int:
    return gallery.VOCAB if MODELS[name].get("task") == "language-model" else 10


def _sim(name: str, method: str, tmp_path: Path) -> dict[str, Any]:
    spec = MODELS[name]
    data = tmp_path / "train.npz"
    _write_data(spec["data"], spec["input_shape"], data)
    fields = {k: v for k, v in spec.items() if k != "data"}
    config = parse_sim_config(
        {
            "model": _model_path(name),
            "num_classes": _classes(name),
            **fields,
            "data": f"npz:{data}",
            "clients": 2,
            "rounds": 2,
            "batch_size": 16,
            "method": method,
            "measure_memory": False,
            "workers": 1,
        }
    )
    return simulate(config, tmp_path / method)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gallery_model_simulates_in_both_modes_and_exports_checked_onnx(
    name: str, tmp_path: Path
) -> None:
    for method in ("local-loss", "splitfed"):
        summary = _sim(name, method, tmp_path)
        assert [r["round"] for r in summary["rounds"]] == [1, 2], (method, summary["rounds"])
        assert all(np.isfinite(r["loss"]) for r in summary["rounds"]), summary["rounds"]
        assert all(c["examples"] > 0 for c in summary["clients"])
    with open_store(f"sqlite:///{tmp_path / 'local-loss' / 'runs.db'}") as store:
        results = export_run(store, _sim_run(store), tmp_path / "onnx", per_device=True)
    assert len(results) == 1 + 2  # the whole model and each client's segment
    for result in results:
        assert result.ok, (result.name, result.max_abs_diff)
        assert result.path.stat().st_size > 0
    # the state dict beside it loads into the user's own model, which computes what the
    # exported file does
    spec, shape = MODELS[name], tuple(MODELS[name]["input_shape"])
    if name == "resnet8":  # the zoo's: an nn.Sequential of its blocks
        own = build_model(name, shape, 10).full()
    else:
        own = getattr(gallery, name)(shape, _classes(name))
    own.load_state_dict(load_file(results[0].path.with_suffix(".safetensors")))
    ids = (0, spec["input_range"]) if "input_range" in spec else None  # token ids
    check = check_onnx(results[0].path, own, shape, input_range=ids)
    assert check.max_abs_diff < 1e-4, check


def _sim_run(store: Any) -> str:
    (run,) = store.list_runs()
    return str(run.run_id)


def _run_config(name: str, tmp_path: Path, rounds: int) -> RunConfig:
    spec = MODELS[name]
    for index, edge in enumerate(EDGES):
        _write_data(spec["data"], spec["input_shape"], tmp_path / f"{edge}.npz", 96, index)
    _write_data(spec["data"], spec["input_shape"], tmp_path / "test.npz", 64, 9)
    fields = {k: v for k, v in spec.items() if k != "data"}
    return RunConfig.parse(
        {
            "run_id": "gallery-1",
            "model": _model_path(name),
            "num_classes": _classes(name),
            **fields,
            "eval_data": f"npz:{tmp_path / 'test.npz'}",
            "devices": {"edges": list(EDGES), "gpu_servers": 1, "wait": "30s"},
            "rounds": rounds,
            "batch_size": 16,
            "optimizer": {"name": "sgd-momentum", "lr": 0.05},
            "round_deadline": "60s",
        }
    )


def _fleet(hub: InProcessHub, tmp_path: Path, name: str) -> list[object]:
    models = (_model_path(name),)  # the agents may build this import path, as --model says
    agents: list[object] = [
        GpuAgent(
            Announcement("gpu-a", "gpu", 1 << 30, 1e9),
            hub.connect("gpu-a-control", node_will(node_id_for("gpu-a"), "gpu-a")),
            hub.connect("gpu-a-stream"),
            models=models,
        )
    ]
    for edge in EDGES:
        agents.append(
            EdgeAgent(
                Announcement(edge, "edge", 1 << 30, 1e12, 1e7),
                load_dataset(f"npz:{tmp_path / f'{edge}.npz'}"),
                hub.connect(f"{edge}-control", node_will(node_id_for(edge), edge)),
                hub.connect(f"{edge}-stream"),
                models=models,
            )
        )
    return agents


@pytest.mark.parametrize(
    "name",
    ["resnet8", "mobilenet_v3_small", "transformer_classifier", "masked_transformer", "tiny_gpt"],
)
def test_gallery_model_resumes_after_a_coordinator_restart(name: str, tmp_path: Path) -> None:
    first = _run_config(name, tmp_path, rounds=1)
    # measured in a fresh process once per model, loss and batch in this process: the
    # simulation test above already profiled it (a minute for mobilenet_v3_small)
    profile = model_profile(first.model, first.training)
    with open_store(f"sqlite:///{tmp_path / 'runs.db'}") as store:
        hub = InProcessHub()
        _fleet(hub, tmp_path, name)
        assert Coordinator(first, store, hub.connect("c1"), profile=lambda _: profile).run() == 1
        # a new coordinator process on the same store continues from the committed round
        again = _run_config(name, tmp_path, rounds=2)
        assert Coordinator(again, store, hub.connect("c2"), profile=lambda _: profile).run() == 1
        run = store.get_run("gallery-1")
        assert run.status == "finished" and run.current_round == 2
        results = export_run(store, "gallery-1", tmp_path / "onnx")
    assert results[0].ok, results[0].max_abs_diff


def test_the_model_section_carries_token_inputs_to_every_role() -> None:
    spec = ModelConfig(
        "tests.fixtures.gallery:lstm_classifier", (12,), 10, "int64", (0, gallery.VOCAB)
    )
    model = spec.build(seed=0)
    x = model.example_input(4)
    assert x.dtype.is_floating_point is False
    assert int(x.min()) >= 0 and int(x.max()) < gallery.VOCAB


def test_a_language_model_learns_next_tokens_across_the_split(tmp_path: Path) -> None:
    summary = _sim("tiny_gpt", "local-loss", tmp_path)
    chance = 1 / gallery.VOCAB
    # per-token accuracy on held-out runs: the step is readable after two tokens
    assert summary["final_accuracy"] > 5 * chance, summary["rounds"]
