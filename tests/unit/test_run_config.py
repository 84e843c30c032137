"""RUN.yaml: the issue's example parses; every bad key or value is rejected by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from coordinator.config import RunConfig, describe_changes, load_run_config, parse_duration
from split_models.errors import ConfigError

pytestmark = pytest.mark.unit

EXAMPLE = Path(__file__).resolve().parents[2] / "coordinator" / "examples" / "run.yaml"


def example() -> dict[str, object]:
    return yaml.safe_load(EXAMPLE.read_text())  # type: ignore[no-any-return]


def test_the_example_parses_with_every_field() -> None:
    config = load_run_config(EXAMPLE)
    model, training = config.model, config.training
    assert (config.run_id, model.name, model.input_shape, model.num_classes) == (
        "demo-1",
        "cnn",
        (1, 28, 28),
        10,
    )
    assert config.devices.edge_count == 3 and config.devices.gpu_servers == 1
    assert config.devices.wait_seconds == 120.0 and training.round_deadline_seconds == 300.0
    assert (training.rounds, training.local_epochs, training.batch_size, training.seed) == (
        3,
        1,
        32,
        0,
    )
    assert training.optimizer.name == "sgd-momentum" and training.optimizer.lr == 0.01
    assert (training.local_loss, training.mode, training.compression) == (
        "linear",
        "local-loss",
        "fp16",
    )
    assert config.aggregation.name == "fedavg"
    # a relative path in the file is relative to the file
    assert config.data.eval_data == f"npz:{EXAMPLE.parent / 'path/to/test.npz'}"
    stored = json.loads(json.dumps(config.to_dict()))  # what the run store keeps
    assert stored["input_shape"] == [1, 28, 28] and stored["devices"]["edges"] == 3
    assert stored["optimizer"]["lr"] == 0.01 and stored["round_deadline"] == 300.0
    assert RunConfig.parse(stored) == config


def test_minimal_config_gets_defaults_and_named_edges() -> None:
    config = RunConfig.parse(
        {
            "run_id": "r",
            "model": "mlp",
            "input_shape": [1, 8, 8],
            "num_classes": 10,
            "devices": {"edges": ["pi-01", "pi-02"]},
            "rounds": 2,
            "strategy": {"name": "FedAdam", "eta": 0.01},
        }
    )
    assert config.devices.edges == ("pi-01", "pi-02") and config.devices.edge_count == 2
    assert config.aggregation.name == "fedadam" and config.aggregation.options == {"eta": 0.01}
    assert config.training.mode == "local-loss" and config.training.batch_size == 32


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"colour": "blue"}, r"unknown key\(s\) \['colour'\]"),
        ({"devices": {"edges": 3, "gpus": 1}}, r"devices: unknown key\(s\) \['gpus'\]"),
        ({"optimizer": {"name": "sgd", "lr": 0.1, "beta": 2}}, r"optimizer: unknown key"),
        ({"mode": "telepathy"}, r"mode: 'telepathy' is not one of"),
        ({"compression": "fp8"}, r"compression: 'fp8'"),
        ({"local_loss": "hinge"}, r"local_loss: 'hinge'"),
        ({"strategy": {"name": "fedmagic"}}, r"strategy.name: 'fedmagic' is not one of \['fedavg'"),
        ({"rounds": 0}, r"rounds: expected an integer in \[1, 1000000\]"),
        ({"federated_eval": 1.0}, r"federated_eval: expected the share"),
        ({"federated_eval": True}, r"federated_eval: expected the share"),
        ({"batch_size": "32"}, r"batch_size: expected an integer"),
        ({"input_shape": [1, 0, 28]}, r"input_shape"),
        ({"run_id": "a/b"}, r"run_id: 'a/b' cannot be used in a topic"),
        ({"round_deadline": "soon"}, r"round_deadline: expected a duration"),
        ({"devices": {"edges": ["pi", "pi"]}}, r"devices.edges: expected unique"),
        ({"optimizer": {"name": "sgd", "lr": -1}}, r"optimizer.lr"),
        ({"optimizer": {"name": "sgd", "lr": 1, "clip_norm": -1}}, r"optimizer.clip_norm"),
        ({"server_clip_norm": 0}, r"server_clip_norm: expected a positive number"),
        ({"max_activation": 0}, r"max_activation: expected a positive number"),
        ({"deterministic": "yes"}, r"deterministic: expected true or false"),
        (
            {"strategy": {"name": "fedtrimmedavg", "beta": 0.6}},
            r"strategy 'fedtrimmedavg': beta: expected a number in \[0, 0.5\), got 0.6",
        ),
        (
            {"strategy": {"name": "krum", "f": 1}},
            r"strategy 'krum': bad option: .*'f'; it takes .*norm_bound, num_malicious_nodes$",
        ),
    ],
)
def test_bad_configs_name_the_key(change: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunConfig.parse(example() | change)


def test_missing_required_keys_and_files() -> None:
    data = example()
    del data["rounds"]
    with pytest.raises(ConfigError, match=r"missing key\(s\) \['rounds'\]"):
        RunConfig.parse(data)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_run_config("no/such/run.yaml")


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("120s", 120), ("5m", 300), ("1h", 3600), ("500ms", 0.5), (42, 42), ("7", 7)],
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text, "wait") == seconds


def test_a_nested_model_section_reads_as_the_flat_keys() -> None:
    base = {"run_id": "r", "devices": {"edges": ["pi-01"]}, "rounds": 1}
    nested = RunConfig.parse(
        {**base, "model": {"name": "mlp", "input_shape": [1, 8, 8], "num_classes": 10}}
    )
    flat = RunConfig.parse({**base, "model": "mlp", "input_shape": [1, 8, 8], "num_classes": 10})
    assert nested == flat
    with pytest.raises(ConfigError, match=r"model\.num_classes: given twice"):
        RunConfig.parse({**base, "model": {"name": "mlp", "num_classes": 10}, "num_classes": 3})
    with pytest.raises(ConfigError, match=r"model\.widht: unknown key"):
        RunConfig.parse({**base, "model": {"name": "mlp", "widht": 3}, "num_classes": 3})
    with pytest.raises(ConfigError, match="needs its name"):
        RunConfig.parse({**base, "model": {"input_shape": [1, 8, 8]}, "num_classes": 3})


def test_numbers_in_exponent_form_parse_though_yaml_reads_them_as_text() -> None:
    from split_models.config import TrainingConfig

    data = yaml.safe_load("rounds: 2\nmax_activation: 1e6\noptimizer: {name: adam, lr: 1e-3}\n")
    assert data["max_activation"] == "1e6"  # PyYAML's YAML 1.1: no dot, no number
    training = TrainingConfig.parse(data)
    assert training.max_activation == 1e6 and training.optimizer.lr == 1e-3
    with pytest.raises(ConfigError, match="max_activation"):
        TrainingConfig.parse({"rounds": 2, "max_activation": "1e6x"})


@pytest.mark.parametrize(
    ("strategy", "anchors"),
    [
        ({"name": "fedprox", "proximal_mu": 0.1}, True),
        ({"name": "fedprox", "proximal_mu": 0.0}, False),
        ({"name": "fedprox"}, False),  # Flower's default mu is 0: FedAvg, no anchor kept
        ({"name": "fedavg"}, False),
    ],
)
def test_fedprox_with_a_proximal_term_plans_for_its_anchor(
    strategy: dict[str, object], anchors: bool
) -> None:
    from coordinator.config import AggregationConfig

    assert AggregationConfig.parse(strategy).anchors is anchors


def test_gpu_servers_bound_the_backs_step_by_default_and_take_the_lower_bounds() -> None:
    from split_models.config import TrainingConfig

    default = TrainingConfig.parse({"rounds": 1}).server_optimizer()
    assert (default.max_step, default.clip_norm) == (0.05, None)
    both = TrainingConfig.parse(
        {
            "rounds": 1,
            "server_clip_norm": 2.0,
            "optimizer": {"name": "sgd", "clip_norm": 1.0, "max_step": 0.5},
        }
    )
    assert (both.server_optimizer().max_step, both.server_optimizer().clip_norm) == (0.05, 1.0)
    assert both.optimizer.max_step == 0.5, "the edges keep the optimizer as configured"
    off = TrainingConfig.parse({"rounds": 1, "server_max_step": None}).server_optimizer()
    assert (off.max_step, off.clip_norm) == (None, None)


def test_a_changed_section_is_described_by_the_keys_that_differ_in_it() -> None:
    """A resume refused for a default that changed inside ``optimizer`` names that key."""
    stored = {"name": "sgd-momentum", "lr": 0.01, "head_lr_scale": 1.0}
    now = {"name": "sgd-momentum", "lr": 0.01, "head_lr_scale": None}
    changes = {"batch_size": (16, 8), "optimizer": (stored, now)}
    assert describe_changes(changes) == "batch_size 16 -> 8; optimizer.head_lr_scale 1.0 -> None"


def test_a_shape_on_the_command_line_is_sizes_and_nothing_else() -> None:
    from coordinator.commands import parse_shape

    assert (
        parse_shape("1,28,28") == parse_shape("1x28x28") == parse_shape("1, 28, 28") == (1, 28, 28)
    )
    for typo in ("1,x", "1,8,8,", "1,8,8x", "", "1,0,8", "a,b"):
        with pytest.raises(ConfigError, match="expected positive sizes"):
            parse_shape(typo)
