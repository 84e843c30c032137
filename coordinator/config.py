"""The run configuration (RUN.yaml): one typed tree, every key validated, unknown keys rejected.

```yaml
run_id: demo-1
model: cnn                      # zoo name or package.module:function (any nn.Module)
input_shape: [1, 28, 28]
num_classes: 10
input_dtype: float32            # int64 for token ids, with input_range: N (ids in [0, N))
task: classification            # or language-model: the next token at every position
split_points: []                # optional: module names the model may be cut before
eval_data: npz:path/to/test.npz  # relative to this file
devices: {edges: 3, gpu_servers: 1, wait: 120s}   # or edges: [pi-01, ...]; cuts: uniform
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

**The file stays flat; the object is sectioned.** ``RunConfig`` has one section per component:
``model`` (``ModelConfig``: ``model``, ``input_shape``, ``num_classes``), ``data``
(``DataConfig``: ``eval_data``), ``devices`` (``DevicesConfig``, the ``devices`` mapping),
``training`` (``split_models.config.TrainingConfig``: ``rounds``, ``local_epochs``,
``batch_size``, ``optimizer``, ``local_loss``, ``mode``, ``compression``, ``seed``,
``round_deadline``, ``federated_eval``) and ``aggregation`` (``AggregationConfig``, the
``strategy`` mapping). Each flat key belongs to exactly one section, so every RUN.yaml written
so far parses unchanged and ``to_dict()`` (what the run store keeps) writes the same flat keys,
which ``parse`` reads back to an equal object. Configs stored by earlier versions
(``round_deadline_seconds``, ``devices.wait_seconds``, ``strategy: NAME`` with
``strategy_options``) parse too. The transport and the store are configured per process, not
per run: ``--broker`` becomes a ``wire.mqtt.MqttConfig`` and ``--db`` a store URL; they stay
out of the stored run (a broker URL may carry a password, and the store is where the run is).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from coordinator.plan_config import CUTS
from coordinator.strategy_options import option_names
from split_models.config import (
    MODES,
    ModelConfig,
    TrainingConfig,
    config_to_dict,
    parse_config,
    parse_duration,
    setting,
)
from split_models.data import resolve_spec
from split_models.errors import ConfigError
from split_models.options import add_model_path, warn_unused_optimizer_keys
from split_models.sections import flat_model_section
from split_models.yamlfile import load_yaml
from wire.topics import check_name

__all__ = [
    "MODES",
    "AggregationConfig",
    "DataConfig",
    "DevicesConfig",
    "RunConfig",
    "load_run_config",
    "parse_duration",
]


def _edges(value: object, path: str) -> int | tuple[str, ...]:
    if isinstance(value, list | tuple):
        names = []
        for name in value:
            try:
                names.append(check_name(str(name), path))
            except ValueError as error:
                raise ConfigError(str(error)) from error
        if not names or len(set(names)) != len(names):
            raise ConfigError(f"{path}: expected unique device names, at least one, got {value!r}")
        return tuple(names)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"{path}: expected an integer >= 1 or a list of names, got {value!r}")
    return value


@dataclass(frozen=True)
class DevicesConfig:
    """Which devices a run waits for: a count of edges and of GPU servers, or their names
    (then no other device takes part, whoever else is on the broker)."""

    edges: int | tuple[str, ...] = setting(parse=_edges)
    gpu_servers: int | tuple[str, ...] = setting(1, parse=_edges)
    wait_seconds: float = setting(120.0, key="wait", aliases=("wait_seconds",), kind="duration")
    # re-plan between rounds when a device's measured speed is off the one the plan used by
    # more than this share (coordinator.speed); null: keep the plan
    replan_drift: float | None = setting(
        0.25, above=0, what="a share such as 0.25 (or null: never re-plan from speeds)"
    )

    # per-device: each edge the cut that suits it; uniform: one cut for all edges
    cuts: str = setting("per-device", choices=CUTS)

    @property
    def edge_count(self) -> int:
        return self.edges if isinstance(self.edges, int) else len(self.edges)


@dataclass(frozen=True)
class DataConfig:
    """The held-out set the coordinator evaluates the assembled model on (none: no eval)."""

    eval_data: str | None = setting(None, what="a dataset spec such as npz:PATH")


@dataclass(frozen=True)
class AggregationConfig:
    """The Flower strategy that aggregates the replicas, and its options
    (``strategy: {name: fedadam, eta: 0.01}``; a bare name is read as ``{name: NAME}``)."""

    name: str = "fedavg"
    options: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, value: object, path: str = "strategy") -> AggregationConfig:
        data = {"name": value} if isinstance(value, str) else value
        if not isinstance(data, Mapping) or "name" not in data:
            raise ConfigError(
                f"{path}: expected {{name: STRATEGY, option: value...}}, got {value!r}"
            )
        # Flower loads only when a run is read
        from coordinator.aggregation import STRATEGIES, check_strategy

        name = str(data["name"]).lower()
        if name not in STRATEGIES:
            raise ConfigError(f"{path}.name: {data['name']!r} is not one of {list(STRATEGIES)}")
        options = {k: v for k, v in data.items() if k != "name"}
        check_strategy(name, options)  # a bad option fails here, not rounds later
        return cls(name, options)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, **self.options}

    @staticmethod
    def option_keys() -> frozenset[str]:
        """The keys a strategy section takes (a config names it when one is written outside)."""
        return option_names() | {"name"}

    @property
    def anchors(self) -> bool:
        """Whether every device keeps a copy of the round's weights (FedProx's anchor, for
        its proximal term; none at ``proximal_mu: 0``, Flower's default)."""
        mu = self.options.get("proximal_mu", 0.0)
        return self.name == "fedprox" and isinstance(mu, int | float) and mu > 0


@dataclass(frozen=True)
class RunConfig:
    """A validated run configuration; ``to_dict`` is what the run store keeps."""

    run_id: str = setting(kind="name")
    model: ModelConfig = setting(flat=True)
    devices: DevicesConfig = setting()
    training: TrainingConfig = setting(flat=True)
    data: DataConfig = setting(factory=DataConfig, flat=True)
    aggregation: AggregationConfig = setting(
        factory=AggregationConfig,
        key="strategy",
        parse=AggregationConfig.parse,
        dump=AggregationConfig.to_dict,
    )

    @classmethod
    def parse(cls, data: object) -> RunConfig:
        """Read RUN.yaml's mapping (or a stored ``to_dict()``, of this version or earlier)."""
        if isinstance(data, Mapping):
            data = flat_model_section(data)
        if isinstance(data, Mapping) and "strategy_options" in data:  # stored before sections
            fields = dict(data)
            options = fields.pop("strategy_options")
            if not isinstance(options, Mapping):
                raise ConfigError(f"strategy_options: expected a mapping, got {options!r}")
            fields["strategy"] = {"name": fields.get("strategy", "fedavg"), **options}
            data = fields
        return parse_config(cls, data, "run config")

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data under the RUN.yaml keys; ``parse`` reads it back equal."""
        return config_to_dict(self)


# What a resumed run may not change without ``--allow-config-change``: the network (never:
# the stored weights would not fit) and everything that changes how a round trains.
STRUCTURE_KEYS = (
    "model",
    "input_shape",
    "num_classes",
    "input_dtype",
    "input_range",
    "split_points",
    "task",
)
TRAINING_KEYS = (
    "local_epochs",
    "batch_size",
    "optimizer",
    "local_loss",
    "mode",
    "compression",
    "strategy",
    "seed",
    "server_clip_norm",
    "server_max_step",
    "max_activation",
    "server_fill",
    "norm",
    "head_from_back",
)


def config_changes(
    stored: Mapping[str, Any], config: RunConfig, keys: tuple[str, ...]
) -> dict[str, tuple[Any, Any]]:
    """The ``keys`` whose value in ``config`` differs from the ``stored`` config (read with
    this version's defaults, so keys added since compare equal): key -> (stored, now)."""
    then, now = RunConfig.parse(stored).to_dict(), config.to_dict()
    return {key: (then.get(key), now.get(key)) for key in keys if then.get(key) != now.get(key)}


def describe_changes(changes: Mapping[str, tuple[Any, Any]]) -> str:
    """``batch_size 32 -> 64; optimizer.lr 0.01 -> 0.05``: a section (a mapping on both
    sides) by the keys that differ in it, so a default that changed inside one is named."""
    parts = []
    for key, (then, now) in changes.items():
        if isinstance(then, Mapping) and isinstance(now, Mapping):
            inner = {k: (then.get(k), now.get(k)) for k in {**then, **now}}
            parts += [f"{key}.{k} {a!r} -> {b!r}" for k, (a, b) in inner.items() if a != b]
        else:
            parts.append(f"{key} {then!r} -> {now!r}")
    return "; ".join(parts)


def load_run_config(path: str | Path) -> RunConfig:
    """Read and validate a RUN.yaml file. Data paths in it are relative to its folder, and a
    ``package.module:function`` model is also looked for there."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"run config {str(path)!r} cannot be read: {error.strerror}") from error
    try:
        data = load_yaml(text)
    except yaml.YAMLError as error:
        raise ConfigError(f"run config {str(path)!r} is not valid YAML: {error}") from error
    folder = Path(path).parent
    add_model_path(folder)
    if isinstance(data, dict) and isinstance(data.get("eval_data"), str):
        data = {**data, "eval_data": resolve_spec(data["eval_data"], folder)}
    config = RunConfig.parse(data)
    warn_unused_optimizer_keys(path, data, config.training.optimizer)
    return config
