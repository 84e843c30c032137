"""The run configuration (RUN.yaml): every key validated, unknown keys rejected by name.

```yaml
run_id: demo-1
model: cnn                      # zoo name or package.module:function
input_shape: [1, 28, 28]
num_classes: 10
eval_data: npz:path/to/test.npz
devices: {edges: 3, gpu_servers: 1, wait: 120s}   # or edges: [pi-01, pi-02, ...]
rounds: 3
local_epochs: 1
batch_size: 32
optimizer: {name: sgd-momentum, lr: 0.01}
local_loss: linear              # linear | mlp | supcon
mode: local-loss                # local-loss | backprop
compression: fp16               # fp32 | fp16 | bf16 | int8
strategy: {name: fedavg}        # any name in coordinator.aggregation.STRATEGIES, with options
round_deadline: 300s
seed: 0
federated_eval: 0.2             # optional: share of each edge's data held out; edges evaluate
                                # the assembled model on it every round (0, the default: off)
```
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from coordinator.aggregation import STRATEGIES
from split_models.errors import ConfigError
from split_models.heads import LOCAL_LOSSES
from split_models.segment import OptimizerConfig
from wire.codec import ENCODINGS
from wire.topics import check_name

__all__ = ["MODES", "DevicesConfig", "RunConfig", "load_run_config", "parse_duration"]

MODES = ("local-loss", "backprop")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(value: object, field_name: str) -> float:
    """Seconds from ``120``, ``"120s"``, ``"5m"``, ``"1h"`` or ``"500ms"``."""
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}: expected a duration such as 120s, got {value!r}")
    if isinstance(value, int | float):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise ConfigError(
                f"{field_name}: expected a duration such as 120s or 5m, got {value!r}"
            )
        seconds = float(match.group(1)) * _SECONDS[match.group(2)]
    if seconds <= 0:
        raise ConfigError(f"{field_name}: must be positive, got {value!r}")
    return seconds


def _name(value: object, field_name: str) -> str:
    try:
        return check_name(str(value), field_name)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _expect_keys(
    data: object, where: str, required: set[str], optional: set[str]
) -> dict[str, Any]:
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {type(data).__name__}")
    unknown = sorted(set(data) - required - optional)
    if unknown:
        valid = ", ".join(sorted(required | optional))
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {valid}")
    missing = sorted(required - set(data))
    if missing:
        raise ConfigError(f"{where}: missing key(s) {missing}")
    return dict(data)


def _integer(data: Mapping[str, Any], key: str, minimum: int, where: str = "") -> int:
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{where}{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _choice(data: Mapping[str, Any], key: str, options: tuple[str, ...]) -> str:
    value = data[key]
    if value not in options:
        raise ConfigError(f"{key}: {value!r} is not one of {list(options)}")
    return str(value)


@dataclass(frozen=True)
class DevicesConfig:
    """Which devices a run waits for: a count of edges, or their names."""

    edges: int | tuple[str, ...]
    gpu_servers: int = 1
    wait_seconds: float = 120.0

    @property
    def edge_count(self) -> int:
        return self.edges if isinstance(self.edges, int) else len(self.edges)

    @classmethod
    def parse(cls, data: object) -> DevicesConfig:
        fields = _expect_keys(data, "devices", {"edges"}, {"gpu_servers", "wait"})
        edges = fields["edges"]
        if isinstance(edges, list):
            names = tuple(_name(e, "devices.edges") for e in edges)
            if not names or len(set(names)) != len(names):
                raise ConfigError("devices.edges: expected unique device names, at least one")
            parsed: int | tuple[str, ...] = names
        else:
            parsed = _integer(fields, "edges", 1, "devices.")
        return cls(
            edges=parsed,
            gpu_servers=_integer(fields, "gpu_servers", 1, "devices.")
            if "gpu_servers" in fields
            else 1,
            wait_seconds=parse_duration(fields.get("wait", 120), "devices.wait"),
        )


@dataclass(frozen=True)
class RunConfig:
    """A validated run configuration; ``to_dict`` is what the run store keeps."""

    run_id: str
    model: str
    input_shape: tuple[int, ...]
    num_classes: int
    devices: DevicesConfig
    rounds: int
    eval_data: str | None = None
    local_epochs: int = 1
    batch_size: int = 32
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    local_loss: str = "linear"
    mode: str = "local-loss"
    compression: str = "fp32"
    strategy: str = "fedavg"
    strategy_options: dict[str, Any] = field(default_factory=dict)
    round_deadline_seconds: float = 300.0
    seed: int = 0
    federated_eval: float = 0.0

    _REQUIRED = frozenset({"run_id", "model", "input_shape", "num_classes", "devices", "rounds"})
    _OPTIONAL = frozenset(
        {
            "eval_data",
            "local_epochs",
            "batch_size",
            "optimizer",
            "local_loss",
            "mode",
            "compression",
            "strategy",
            "round_deadline",
            "seed",
            "federated_eval",
        }
    )

    @classmethod
    def parse(cls, data: object) -> RunConfig:
        fields = _expect_keys(data, "run config", set(cls._REQUIRED), set(cls._OPTIONAL))
        shape = fields["input_shape"]
        if (
            not isinstance(shape, list)
            or not shape
            or any(isinstance(d, bool) or not isinstance(d, int) or d < 1 for d in shape)
        ):
            raise ConfigError(f"input_shape: expected a list of positive integers, got {shape!r}")
        optimizer = _expect_keys(
            fields.get("optimizer", {}),
            "optimizer",
            set(),
            {"name", "lr", "momentum", "weight_decay"},
        )
        strategy = _expect_keys(
            fields.get("strategy", {"name": "fedavg"}),
            "strategy",
            {"name"},
            set(fields.get("strategy", {})) - {"name"},
        )
        model = fields["model"]
        if not isinstance(model, str) or not model:
            raise ConfigError(
                f"model: expected a zoo name or package.module:function, got {model!r}"
            )
        defaults = {
            "local_epochs": 1,
            "batch_size": 32,
            "seed": 0,
            "local_loss": "linear",
            "mode": "local-loss",
            "compression": "fp32",
        }
        merged = {**defaults, **fields}
        eval_data = fields.get("eval_data")
        if eval_data is not None and (not isinstance(eval_data, str) or not eval_data):
            raise ConfigError(
                f"eval_data: expected a dataset spec such as npz:PATH, got {eval_data!r}"
            )
        federated = fields.get("federated_eval", 0.0)
        if isinstance(federated, bool) or not isinstance(federated, int | float):
            federated = -1
        if not 0 <= federated < 1:
            raise ConfigError(
                "federated_eval: expected the share of each edge's data to hold out for "
                f"evaluation, in [0, 1) (0: off), got {fields.get('federated_eval')!r}"
            )
        try:
            optimizer_config = OptimizerConfig(**optimizer)
        except TypeError as error:
            raise ConfigError(f"optimizer: {error}") from error
        return cls(
            run_id=_name(fields["run_id"], "run_id"),
            model=model,
            input_shape=tuple(shape),
            num_classes=_integer(fields, "num_classes", 2),
            devices=DevicesConfig.parse(fields["devices"]),
            rounds=_integer(fields, "rounds", 1),
            eval_data=eval_data,
            local_epochs=_integer(merged, "local_epochs", 1),
            batch_size=_integer(merged, "batch_size", 1),
            optimizer=optimizer_config,
            local_loss=_choice(merged, "local_loss", LOCAL_LOSSES),
            mode=_choice(merged, "mode", MODES),
            compression=_choice(merged, "compression", ENCODINGS),
            strategy=_choice({"strategy": str(strategy["name"]).lower()}, "strategy", STRATEGIES),
            strategy_options={k: v for k, v in strategy.items() if k != "name"},
            round_deadline_seconds=parse_duration(
                fields.get("round_deadline", 300), "round_deadline"
            ),
            seed=_integer(merged, "seed", 0),
            federated_eval=float(federated),
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["input_shape"] = list(self.input_shape)
        if isinstance(self.devices.edges, tuple):
            data["devices"]["edges"] = list(self.devices.edges)
        return data


def load_run_config(path: str | Path) -> RunConfig:
    """Read and validate a RUN.yaml file."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"run config {str(path)!r} cannot be read: {error.strerror}") from error
    try:
        return RunConfig.parse(yaml.safe_load(text))
    except yaml.YAMLError as error:
        raise ConfigError(f"run config {str(path)!r} is not valid YAML: {error}") from error
