"""The simulation configuration (SIM.yaml): the run's sections plus the simulation's own.

```yaml
model: cnn                            # the run's model section: model, input_shape, num_classes
input_shape: [1, 8, 8]
num_classes: 10
data: digits                          # or npz:PATH, torchvision:MNIST:ROOT, folder:PATH
test_data: npz:test.npz               # optional; else test_fraction of data is held out
test_fraction: 0.25
clients: 4
partition: {kind: iid}                # or {kind: dirichlet, alpha: 0.5}, {kind: shards, ...}
devices:                              # client profiles mixed by share
  - {profile: small, share: 0.5, memory: 8MiB, flops: 2e9, uplink: 20Mbit}
  - {profile: large, share: 0.5, memory: 64MiB, flops: 5e10, uplink: 100Mbit}
cuts: per-device                      # or uniform: one cut for every client
gpu: {memory: 16GiB, flops: 5e13, device: cpu}   # device: where the GPU server trains
availability: {online: 0.9, offline: {client-003: [2, 3]}}   # optional
workers: 4                            # clients stepping at once (default: one per core)
interleave: true                      # the round's clients train at once, in turns by step
measure_memory: true                  # each assignment's real peak, in a fresh process
batched: false                        # vmapped client steps (simulation.stack)
group_clients: false                  # one agent per profile trains its clients (hosts)
client_device: cpu                    # cpu | cuda | cuda:N | mps
method: local-loss                    # local-loss | splitfed | fedavg | centralized
rounds: 3                             # the run's training section (but mode: from method)
local_epochs: 1
batch_size: 32
optimizer: {name: adam, lr: 0.002}
local_loss: linear
compression: fp32
seed: 0
federated_eval: 0.0
strategy: {name: fedavg}              # the run's aggregation section
```

Like RUN.yaml the file is flat and the object sectioned: ``SimConfig`` embeds the run
configuration's ``ModelConfig``, ``TrainingConfig`` and ``AggregationConfig`` (with the
simulation's defaults: the digits CNN, 3 rounds, Adam at 0.002), and holds the simulation's own
keys in ``SimDataConfig`` (data, test_data, test_fraction), ``FleetConfig`` (clients, partition,
devices, cuts, availability, workers, interleave, measure_memory, batched, client_device,
group_clients)
and ``GpuConfig``. The
training mode is not a key: ``method`` sets it (splitfed trains by back-propagation); the round
deadline is the simulation's (600 s). Every default is a dataclass field's; ``to_dict()`` writes
the flat keys that ``parse_sim_config`` reads back to an equal object.
"""

from __future__ import annotations

import math
import os
import random
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace
from itertools import accumulate
from pathlib import Path
from typing import Any

import yaml

from coordinator.config import AggregationConfig, DataConfig, DevicesConfig, RunConfig
from coordinator.plan_config import CUTS
from split_models.config import (
    ModelConfig,
    TrainingConfig,
    config_to_dict,
    parse_config,
    setting,
)
from split_models.data import PARTITIONS, resolve_spec
from split_models.errors import ConfigError
from split_models.options import OptimizerConfig, add_model_path, warn_unused_optimizer_keys
from split_models.sections import flat_model_section
from split_models.yamlfile import load_yaml
from wire.topics import check_name

__all__ = [
    "BASELINES",
    "GROUPABLE",
    "METHODS",
    "Availability",
    "FleetConfig",
    "GpuConfig",
    "Partition",
    "Profile",
    "SimConfig",
    "SimDataConfig",
    "client_names",
    "load_sim_config",
    "parse_sim_config",
    "run_config",
]

METHODS = {"local-loss": "local-loss", "splitfed": "backprop"}
BASELINES = ("fedavg", "centralized")
_NOT_KEYS = frozenset({"mode", "round_deadline"})  # set by the method and the simulation


def client_names(count: int) -> list[str]:
    return [f"client-{index:03d}" for index in range(count)]


@dataclass(frozen=True)
class Profile:
    """A client device profile: its memory budget, FLOP/s and uplink, and its share of clients."""

    name: str = setting(key="profile")
    share: float = setting(above=0, maximum=1, what="a fraction")
    memory: int = setting(kind="memory")
    flops: float = setting(kind="flops")
    uplink: float = setting(100e6 / 8, kind="bandwidth")


def _profiles(value: object, path: str) -> tuple[Profile, ...]:
    if not isinstance(value, list | tuple) or not value:
        raise ConfigError(f"{path}: expected a list of {{profile, share, memory, flops, uplink}}")
    profiles = []
    for index, entry in enumerate(value):
        where = f"{path}[{index}]"
        if isinstance(entry, Mapping):  # a profile's name and share default by its place
            entry = {"profile": f"profile-{index}", "share": 1.0 / len(value), **entry}
        profiles.append(parse_config(Profile, entry, where, prefix=f"{where}."))
    total = sum(p.share for p in profiles)
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise ConfigError(f"{path}: shares must add up to 1, got {total}")
    return tuple(profiles)


def _dump_profiles(profiles: tuple[Profile, ...]) -> list[dict[str, Any]]:
    return [config_to_dict(p) for p in profiles]


def _default_profiles() -> tuple[Profile, ...]:
    return (
        Profile("small", 0.5, 8 * 1024**2, 2e9, 20e6 / 8),
        Profile("large", 0.5, 64 * 1024**2, 5e10, 100e6 / 8),
    )


def _offline(value: object, path: str) -> dict[str, tuple[int, ...]]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{path}: expected {{client name: [round, ...]}}, got {value!r}")
    trace = {}
    for name, numbers in value.items():
        if not isinstance(numbers, list | tuple) or not all(
            isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in numbers
        ):
            raise ConfigError(f"{path}.{name}: expected a list of rounds >= 1, got {numbers!r}")
        trace[str(name)] = tuple(numbers)
    return trace


@dataclass(frozen=True)
class Availability:
    """Which clients are offline in which rounds: each client is online with probability
    ``online`` each round (seeded), and offline in the rounds ``offline`` lists for it."""

    online: float = setting(1.0, above=0, maximum=1, what="a fraction")
    offline: Mapping[str, tuple[int, ...]] = setting(factory=dict, parse=_offline)

    def offline_in(self, number: int, names: list[str], seed: int) -> set[str]:
        draw = random.Random(seed * 7_919 + number)
        return {
            name
            for name in names
            if draw.random() >= self.online or number in self.offline.get(name, ())
        }

    def check(self, clients: int, rounds: int, seed: int = 0, needed: int = 1) -> None:
        """Every client named is one of the ``clients``, every round is in 1..``rounds``, and
        every round has the ``needed`` clients online (the strategy's ``min_train_nodes``;
        a round short of them would wait for clients that stay offline until its tries run
        out)."""
        names = set(client_names(clients))
        for name, numbers in self.offline.items():
            if name not in names:
                raise ConfigError(
                    f"availability.offline: {name!r} is not a client (client-000 .. "
                    f"client-{clients - 1:03d})"
                )
            if any(n > rounds for n in numbers):
                raise ConfigError(
                    f"availability.offline.{name}: expected a list of rounds in 1..{rounds}, "
                    f"got {list(numbers)!r}"
                )
        ordered = client_names(clients)  # in the simulation's order: the draws follow it
        for number in range(1, rounds + 1):
            online = clients - len(self.offline_in(number, ordered, seed))
            if online < needed:
                raise ConfigError(
                    f"availability: round {number} has {online} of {clients} clients online, "
                    f"the strategy trains with at least {needed} (min_train_nodes): raise "
                    "availability.online or take that round out of availability.offline"
                )


def _availability(value: object, path: str) -> Availability | None:
    if value is None:
        return None
    return parse_config(Availability, value, path, prefix=f"{path}.")


def _dump_availability(value: Availability | None) -> dict[str, Any] | None:
    return None if value is None else config_to_dict(value)


def _device(value: object, path: str) -> str:
    if not isinstance(value, str) or not re.fullmatch(r"cpu|cuda(:\d+)?|mps", value):
        raise ConfigError(f"{path}: expected cpu, cuda, cuda:N or mps, got {value!r}")
    return value


@dataclass(frozen=True)
class Partition:
    """How the training data is split among clients (``alpha``: dirichlet, ``per_client``:
    shards)."""

    kind: str = setting("iid", choices=PARTITIONS)
    alpha: float = setting(0.5, above=0)
    per_client: int = setting(2, minimum=1)


@dataclass(frozen=True)
class SimDataConfig:
    """The training data and the held-out set (given, or ``test_fraction`` of the data)."""

    data: str = setting("digits", what="a dataset spec such as digits or npz:PATH")
    test_data: str | None = setting(None, what="a dataset spec such as npz:PATH")
    test_fraction: float = setting(0.25, above=0, below=1, what="a fraction")


@dataclass(frozen=True)
class FleetConfig:
    """The simulated clients: how many, their device profiles, data split and availability,
    and how the host trains them."""

    clients: int = setting(4, minimum=1)
    devices: tuple[Profile, ...] = setting(
        factory=_default_profiles, parse=_profiles, dump=_dump_profiles
    )
    partition: Partition = setting(factory=Partition)
    cuts: str = setting("per-device", choices=CUTS)
    availability: Availability | None = setting(None, parse=_availability, dump=_dump_availability)
    workers: int | None = setting(None, minimum=1)
    interleave: bool = True  # the round's clients step in turns (simulation.pace)
    measure_memory: bool = True
    batched: bool = False
    client_device: str = setting("cpu", parse=_device)
    group_clients: bool = False  # one agent per profile trains its clients (simulation.hosts)

    @property
    def worker_count(self) -> int:
        """``workers``, or one per CPU core (at most one per client) when not set."""
        return self.workers or min(os.cpu_count() or 1, self.clients)

    def client_profiles(self) -> dict[str, Profile]:
        """Each client's device profile, by name: clients take the profiles by share, in
        order (50% / 50% of 4 clients: two of each)."""
        bounds = [
            round(total * self.clients) for total in accumulate(p.share for p in self.devices)
        ]
        return {
            name: next(
                (p for p, bound in zip(self.devices, bounds, strict=True) if index < bound),
                self.devices[-1],
            )
            for index, name in enumerate(client_names(self.clients))
        }

    def hosts(self) -> dict[str, tuple[Profile, list[str]]]:
        """With ``group_clients``: each host's profile and clients, by the host's name."""
        profiles = self.client_profiles()
        groups = [(p, [c for c, q in profiles.items() if q is p]) for p in self.devices]
        held = [group for group in groups if group[1]]  # a profile no client drew has no host
        return {f"host-{index}": group for index, group in enumerate(held)}

    def device_profiles(self) -> dict[str, Profile]:
        """The profile of each device the coordinator sees: the hosts, or the clients."""
        if self.group_clients:
            return {name: profile for name, (profile, _) in self.hosts().items()}
        return self.client_profiles()


@dataclass(frozen=True)
class GpuConfig:
    """The simulated GPU server."""

    memory: int = setting(16 * 1024**3, kind="memory")
    flops: float = setting(5e13, kind="flops")
    device: str = setting("cpu", parse=_device)


def _model() -> ModelConfig:
    return ModelConfig("cnn", (1, 8, 8), 10)


def _training() -> TrainingConfig:
    return TrainingConfig(
        rounds=3, optimizer=OptimizerConfig("adam", 0.002), round_deadline_seconds=600.0
    )


@dataclass(frozen=True)
class SimConfig:
    """A validated simulation configuration (see the module docstring for its keys)."""

    method: str = setting("local-loss", choices=(*METHODS, *BASELINES))
    model: ModelConfig = setting(factory=_model, flat=True)
    data: SimDataConfig = setting(factory=SimDataConfig, flat=True)
    fleet: FleetConfig = setting(factory=FleetConfig, flat=True)
    gpu: GpuConfig = setting(factory=GpuConfig)
    training: TrainingConfig = setting(factory=_training, flat=True)
    aggregation: AggregationConfig = setting(
        factory=AggregationConfig,
        key="strategy",
        parse=AggregationConfig.parse,
        dump=AggregationConfig.to_dict,
    )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data under the SIM.yaml keys; ``parse_sim_config`` reads it back."""
        return config_to_dict(self, _NOT_KEYS)


def parse_sim_config(data: object, overrides: Mapping[str, Any] | None = None) -> SimConfig:
    """Read SIM.yaml's mapping (None: every default); ``overrides`` (the command line's
    flags, None where not given) win over the file."""
    fields = flat_model_section(_mapping(data))
    fields.update({k: v for k, v in (overrides or {}).items() if v is not None})
    config = parse_config(SimConfig, fields, "simulation config", SimConfig(), _NOT_KEYS)
    mode = METHODS.get(config.method, "local-loss")
    config = replace(config, training=replace(config.training, mode=mode))
    if config.fleet.group_clients:
        _check_grouping(config)
    needed = int(config.aggregation.options.get("min_train_nodes", 1))
    fleet, training = config.fleet, config.training
    if (availability := fleet.availability) is not None:
        availability.check(fleet.clients, training.rounds, training.seed, needed)
    edges = len(fleet.hosts()) if fleet.group_clients else fleet.clients
    if needed > edges and config.method != "centralized":  # no device can join a simulation
        kind = "hosts (group_clients)" if fleet.group_clients else "clients"
        raise ConfigError(
            f"strategy.min_train_nodes: {needed}, but the simulation has {edges} {kind}: no "
            "round could start; lower it or simulate more clients"
        )
    return config


# the strategies whose mean of the hosts' means is the mean over the clients
GROUPABLE = ("fedavg", "fedprox", "fedavgm", "fedadam", "fedyogi", "fedadagrad")


def _check_grouping(config: SimConfig) -> None:
    """``group_clients`` trains as an agent per client does only for these settings."""
    training, strategy = config.training, config.aggregation.name
    problems = [
        f"strategy {strategy!r}, which judges each reply (grouping needs one of "
        f"{', '.join(GROUPABLE)})"
        if strategy not in GROUPABLE
        else "",
        f"method {config.method!r} (grouping trains local-loss)"
        if config.method != "local-loss"
        else "",
        "norm: local (per-client BatchNorm copies)" if training.norm == "local" else "",
        "batched: true (stacked steps)" if config.fleet.batched else "",
        "federated_eval (the host holds no client's share apart)"
        if training.federated_eval > 0
        else "",
    ]
    if found := [p for p in problems if p]:
        raise ConfigError(
            "group_clients: true cannot be used with "
            + "; ".join(found)
            + "; change those or set group_clients: false"
        )


def _mapping(data: object) -> Mapping[str, Any]:
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"simulation config: expected a mapping, got {type(data).__name__}")
    return data


def load_sim_config(path: str | Path | None, overrides: Mapping[str, Any]) -> SimConfig:
    """Read and validate SIM.yaml (None: the defaults), with the command line's overrides."""
    data = None
    if path is not None:
        try:
            data = load_yaml(Path(path).read_text())
        except OSError as error:
            raise ConfigError(f"simulation config {str(path)!r} cannot be read: {error}") from error
        except yaml.YAMLError as error:
            raise ConfigError(
                f"simulation config {str(path)!r} is not valid YAML: {error}"
            ) from error
        folder = Path(path).parent
        add_model_path(folder)  # a package.module:function model may sit beside the file
        if isinstance(data, dict):  # its data paths are relative to its folder
            data = {
                **data,
                **{
                    key: resolve_spec(data[key], folder)
                    for key in ("data", "test_data")
                    if isinstance(data.get(key), str)
                },
            }
    config = parse_sim_config(data, overrides)
    warn_unused_optimizer_keys(path, data, config.training.optimizer)
    return config


GPU_NAME = "gpu-sim"  # the simulation's GPU server


def run_config(config: SimConfig, run_id: str, eval_data: str | None = None) -> RunConfig:
    """The run the simulated coordinator drives: the simulation's model, training and
    aggregation sections, its clients as the named edges, one GPU server."""
    try:
        check_name(run_id, "run_id")
    except ValueError as error:
        raise ConfigError(str(error)) from error
    fleet, aggregation = config.fleet, config.aggregation
    if fleet.group_clients:  # every host trains; each samples its clients (simulation.hosts)
        options = {**aggregation.options, "fraction_train": 1.0}
        aggregation = replace(aggregation, options=options)
    return RunConfig(
        run_id=run_id,
        model=config.model,
        # simulated devices all run at the host's speed, not their profiles': their measured
        # speeds say nothing of the devices simulated, so the plan stays
        # named: devices of a deployment on the same broker take no part
        devices=DevicesConfig(tuple(fleet.device_profiles()), (GPU_NAME,), 60.0, None, fleet.cuts),
        training=config.training,
        data=DataConfig(eval_data),
        aggregation=aggregation,
    )
