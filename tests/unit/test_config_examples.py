"""Every config example in the repository parses and round-trips through ``to_dict``/``parse``;
configs stored by earlier versions parse; the CLI's defaults are the dataclasses'."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from coordinator.config import RunConfig
from edgesplit.cli import build_parser
from simulation.config import SimConfig, parse_sim_config
from split_models.config import ModelConfig, TrainingConfig, stored_section
from split_models.devices import load_devices

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
_BLOCK = re.compile(r"^```yaml\n(.*?)^```", re.MULTILINE | re.DOTALL)


def _examples() -> list[tuple[str, Any]]:
    """(where, parsed YAML) of every README yaml block and every example YAML file."""
    found = []
    for readme in (ROOT / "README.md", ROOT / "deploy" / "README.md"):
        for index, block in enumerate(_BLOCK.findall(readme.read_text())):
            found.append((f"{readme.relative_to(ROOT)} block {index}", yaml.safe_load(block)))
    files = [
        *(ROOT / "coordinator" / "examples").glob("*.yaml"),
        *(ROOT / "deploy").rglob("*.yaml"),
    ]
    for path in sorted(files):
        found.append((str(path.relative_to(ROOT)), yaml.safe_load(path.read_text())))
    return found


def _kind(data: Any) -> str:
    if isinstance(data, dict) and "run_id" in data:
        return "run"
    if isinstance(data, dict) and set(data) == {"devices"}:
        return "devices"
    return "sim"


EXAMPLES = _examples()


def test_the_examples_cover_run_sim_and_devices_files() -> None:
    kinds = [_kind(data) for _, data in EXAMPLES]
    # README, coordinator/examples and deploy/compose each hold a run config
    assert kinds.count("run") >= 3 and kinds.count("sim") >= 1 and kinds.count("devices") >= 2


@pytest.mark.parametrize(("where", "data"), EXAMPLES, ids=[where for where, _ in EXAMPLES])
def test_every_example_parses_and_round_trips(where: str, data: Any, tmp_path: Path) -> None:
    kind = _kind(data)
    if kind == "devices":
        path = tmp_path / "devices.yaml"
        path.write_text(yaml.safe_dump(data))
        assert load_devices(path), where
        return
    config: RunConfig | SimConfig = (
        RunConfig.parse(data) if kind == "run" else parse_sim_config(data)
    )
    stored = json.loads(json.dumps(config.to_dict()))  # what a store keeps: JSON
    again = RunConfig.parse(stored) if kind == "run" else parse_sim_config(stored)
    assert again == config, where
    assert again.to_dict() == stored, where


def _stored_by_version_0_1() -> dict[str, Any]:
    """A run's config as RunConfig.to_dict() wrote it before the sections (runs.db files)."""
    return {
        "run_id": "old-1",
        "model": "cnn",
        "input_shape": [1, 8, 8],
        "num_classes": 10,
        "devices": {"edges": ["pi-01", "pi-02"], "gpu_servers": 1, "wait_seconds": 60.0},
        "rounds": 2,
        "eval_data": None,
        "local_epochs": 1,
        "batch_size": 16,
        "optimizer": {"name": "adam", "lr": 0.002, "momentum": 0.9, "weight_decay": 0.0},
        "local_loss": "linear",
        "mode": "backprop",
        "compression": "fp16",
        "strategy": "fedadam",
        "strategy_options": {"eta": 0.01},
        "round_deadline_seconds": 600.0,
        "seed": 3,
        "federated_eval": 0.2,
    }


def test_a_config_stored_by_an_earlier_version_parses() -> None:
    config = RunConfig.parse(_stored_by_version_0_1())
    assert config.devices.wait_seconds == 60.0 and config.training.round_deadline_seconds == 600
    assert config.aggregation.name == "fedadam" and config.aggregation.options == {"eta": 0.01}
    assert config.training.mode == "backprop" and config.training.federated_eval == 0.2
    assert RunConfig.parse(config.to_dict()) == config
    assert "round_deadline_seconds" not in config.to_dict()  # read, never written again


def test_sections_read_from_a_whole_stored_config() -> None:
    stored = _stored_by_version_0_1()
    assert stored_section(ModelConfig, stored) == ModelConfig("cnn", (1, 8, 8), 10)
    training = stored_section(TrainingConfig, stored)
    assert (training.rounds, training.batch_size, training.seed) == (2, 16, 3)
    assert training.to_dict() == RunConfig.parse(stored).training.to_dict()
    assert TrainingConfig.parse(training.to_dict()) == training  # a device could be sent it


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"clients": 0}, r"clients: expected an integer >= 1, got 0"),
        ({"mode": "backprop"}, r"unknown key\(s\) \['mode'\]; valid keys: availability"),
        ({"partition": {"kind": "zipf"}}, r"partition.kind: 'zipf' is not one of \['iid'"),
        ({"gpu": {"memory": "lots"}}, r"gpu.memory: cannot parse 'lots'"),
        ({"devices": [{"memory": "1MiB", "flops": 1e9, "share": 2}]}, r"devices\[0\].share"),
        ({"devices": [{"memory": "1MiB"}]}, r"devices\[0\]: missing key\(s\) \['flops'\]"),
        ({"availability": {"offline": {"client-009": [1]}}}, r"'client-009' is not a client"),
        ({"availability": {"offline": {"client-001": [9]}}}, r"rounds in 1..3, got \[9\]"),
        (  # a round nobody trains in waited for clients that stay offline (15 minutes)
            {"clients": 2, "availability": {"offline": {"client-000": [2], "client-001": [2]}}},
            r"availability: round 2 has 0 of 2 clients online, the strategy trains with at least 1",
        ),
        (
            {"clients": 4, "availability": {"online": 0.01}},
            r"availability: round 1 has 0 of 4 clients online",
        ),
        (
            {
                "clients": 3,
                "strategy": {"name": "fedavg", "min_train_nodes": 3},
                "availability": {"offline": {"client-002": [3]}},
            },
            r"round 3 has 2 of 3 clients online, the strategy trains with at least 3",
        ),
        ({"test_fraction": 1}, r"test_fraction: expected a fraction in \(0, 1\), got 1"),
        ({"method": "magic"}, r"method: 'magic' is not one of \['local-loss', 'splitfed'"),
        ({"optimizer": {"name": "adam", "lr": 0}}, r"optimizer.lr: must be positive"),
        ({"client_device": "tpu"}, r"client_device: expected cpu, cuda, cuda:N or mps"),
        ({"gpu": {"device": "gpu0"}}, r"gpu.device: expected cpu, cuda, cuda:N or mps"),
    ],
)
def test_bad_simulation_configs_name_the_key(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_sim_config(change)


def test_simulation_defaults_and_the_training_mode_from_the_method() -> None:
    config = parse_sim_config({"method": "splitfed", "optimizer": {"name": "sgd"}}, {"rounds": 5})
    assert config.training.mode == "backprop" and config.training.rounds == 5
    assert config.training.optimizer.lr == 0.01  # a given optimizer takes its own defaults
    assert parse_sim_config(None) == SimConfig()
    assert SimConfig().training.optimizer.name == "adam" and SimConfig().model.name == "cnn"


def test_cli_defaults_are_the_config_defaults() -> None:
    run = RunConfig.parse(
        {
            "run_id": "r",
            "model": "cnn",
            "input_shape": [1, 28, 28],
            "num_classes": 10,
            "devices": {"edges": 1},
            "rounds": 1,
        }
    )
    plan = build_parser().parse_args(["plan", "--model", "cnn", "--devices", "d.yaml"])
    assert plan.batch_size == run.training.batch_size == 32
    assert plan.optimizer == run.training.optimizer.name
    assert (plan.local_loss, plan.compression) == (
        run.training.local_loss,
        run.training.compression,
    )
    profile = build_parser().parse_args(["profile", "--model", "cnn"])
    assert profile.batch_size == run.training.batch_size
    sim = build_parser().parse_args(["simulate"])
    overrides = {k: getattr(sim, k) for k in ("method", "rounds", "clients", "data", "seed")}
    assert set(overrides.values()) == {None}  # SIM.yaml, then SimConfig, decide


@pytest.mark.parametrize("role", ["edge", "gpu-server"])
@pytest.mark.parametrize("name", ["a/b", "g a", "x" * 65, "+"])
def test_a_device_name_no_topic_can_carry_is_a_usage_error(
    role: str, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    data = ["--data", "digits"] if role == "edge" else []
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args([role, "--id", name, *data])
    assert exited.value.code == 2
    assert "cannot be used in a topic" in capsys.readouterr().err
    assert build_parser().parse_args([role, "--id", "pi-01.a_b", *data]).id == "pi-01.a_b"


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_runs_events_last_takes_a_count_of_one_or_more(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        build_parser().parse_args(["runs", "events", "r", "--db", "x.db", "--last", value])
    assert exited.value.code == 2 and "expected a whole number >= 1" in capsys.readouterr().err
    assert (
        build_parser().parse_args(["runs", "events", "r", "--db", "x.db", "--last", "3"]).last == 3
    )


def test_a_key_written_beside_the_section_that_takes_it_is_pointed_there() -> None:
    from split_models.errors import ConfigError

    for bad, hint in (
        ({"fraction_train": 0.5}, "fraction_train belongs in strategy: {fraction_train: ...}"),
        ({"lr": 0.1}, "lr belongs in optimizer: {lr: ...}"),
        ({"alpha": 0.5}, "alpha belongs in partition: {alpha: ...}"),
    ):
        with pytest.raises(ConfigError, match="unknown key") as raised:
            parse_sim_config(bad)
        assert str(raised.value).endswith(hint), raised.value
    with pytest.raises(ConfigError, match="unknown key") as raised:
        parse_sim_config({"wings": 3})
    assert "belongs in" not in str(raised.value)
    with pytest.raises(ConfigError, match="lr belongs in optimizer"):
        RunConfig.parse({"run_id": "r", "model": "cnn", "lr": 0.1})


@pytest.mark.parametrize("method", ["local-loss", "splitfed", "fedavg"])
def test_a_simulation_refuses_min_train_nodes_above_its_clients(method: str) -> None:
    """Nobody can join a simulation: a round waiting for 10 of 4 clients waited out every
    try's deadline (30 minutes) without a word but 'waits for its devices'."""
    from simulation.config import parse_sim_config
    from split_models.errors import ConfigError

    strategy = {"name": "fedavg", "min_train_nodes": 10}
    with pytest.raises(ConfigError, match="min_train_nodes: 10, but the simulation has 4 clients"):
        parse_sim_config({"method": method, "clients": 4, "strategy": strategy})
    assert parse_sim_config({"method": method, "clients": 10, "strategy": strategy})
    assert parse_sim_config({"method": "centralized", "clients": 4, "strategy": strategy})
