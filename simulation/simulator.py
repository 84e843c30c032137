"""``edgesplit simulate``: the coordinator, a GPU server and N edge clients in one process, on
the same code paths as a deployment (agents, Flower messages, credits, the SQL store).

The transport is in-process by default; ``--broker embedded`` starts a private mosquitto and
``--broker mqtt://...`` uses a running one. Clients get heterogeneous device profiles (memory,
FLOP/s, uplink) mixed by share; the plan respects each client's memory. Results go to
``--out``: ``summary.json``, ``rounds.csv``, ``plan.txt`` and the run store ``runs.db``
(so ``edgesplit status`` and ``edgesplit export`` work on a simulation).

SIM.yaml (every key validated, unknown keys rejected by name); without ``--config`` the
embedded defaults below run on scikit-learn's bundled digits, offline.
"""

from __future__ import annotations

import json
import logging
import math
import os
import random
import re
import time
import uuid
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from coordinator.config import RunConfig, _expect_keys
from coordinator.service import Coordinator, RoundObserver
from edge_client.agent import EdgeAgent
from gpu_server.agent import GpuAgent
from simulation.pool import SegmentPool
from simulation.report import client_rows, round_rows, write_outputs
from split_models.data import PARTITIONS, Dataset, load_dataset, partition
from split_models.errors import ConfigError
from split_models.measure import measure_in_fresh_process
from split_models.segment import Segment
from split_models.units import parse_bandwidth, parse_flops, parse_memory
from storage import open_store
from wire.flower import node_will
from wire.roles import Announcement, node_id_for
from wire.transport import InProcessHub, Transport, Will

__all__ = ["DEFAULTS", "METHODS", "Availability", "SimConfig", "load_sim_config", "simulate"]

log = logging.getLogger(__name__)

METHODS = {"local-loss": "local-loss", "splitfed": "backprop"}
BASELINES = ("fedavg", "centralized")

DEFAULTS: dict[str, Any] = {
    "model": "cnn",
    "input_shape": [1, 8, 8],
    "num_classes": 10,
    "data": "digits",
    "test_fraction": 0.25,
    "clients": 4,
    "partition": {"kind": "iid"},
    "devices": [
        {"profile": "small", "share": 0.5, "memory": "8MiB", "flops": 2e9, "uplink": "20Mbit"},
        {"profile": "large", "share": 0.5, "memory": "64MiB", "flops": 5e10, "uplink": "100Mbit"},
    ],
    "gpu": {"memory": "16GiB", "flops": 5e13},
    "rounds": 3,
    "local_epochs": 1,
    "batch_size": 32,
    "optimizer": {"name": "adam", "lr": 0.002},
    "local_loss": "linear",
    "method": "local-loss",
    "compression": "fp32",
    "strategy": {"name": "fedavg"},
    "seed": 0,
}
_KEYS = set(DEFAULTS) | {
    "test_data",
    "availability",
    "workers",
    "measure_memory",
    "federated_eval",
    "batched",
    "client_device",
}


@dataclass(frozen=True)
class Profile:
    name: str
    share: float
    memory: int
    flops: float
    uplink: float


@dataclass(frozen=True)
class Availability:
    """Which clients are offline in which rounds: each client is online with probability
    ``online`` each round (seeded), and offline in the rounds ``offline`` lists for it."""

    online: float = 1.0
    offline: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def offline_in(self, number: int, names: list[str], seed: int) -> set[str]:
        draw = random.Random(seed * 7_919 + number)
        return {
            name
            for name in names
            if draw.random() >= self.online or number in self.offline.get(name, ())
        }


def _availability(data: object, clients: int, rounds: int) -> Availability | None:
    if data is None:
        return None
    fields = _expect_keys(data, "availability", set(), {"online", "offline"})
    online = fields.get("online", 1.0)
    if isinstance(online, bool) or not isinstance(online, int | float) or not 0 < online <= 1:
        raise ConfigError(f"availability.online: expected a fraction in (0, 1], got {online!r}")
    offline = fields.get("offline", {})
    if not isinstance(offline, dict):
        raise ConfigError("availability.offline: expected {client name: [round, ...]}")
    names = set(client_names(clients))
    trace = {}
    for name, numbers in offline.items():
        if name not in names:
            raise ConfigError(
                f"availability.offline: {name!r} is not a client (client-000 .. "
                f"client-{clients - 1:03d})"
            )
        if not isinstance(numbers, list) or not all(
            isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= rounds for n in numbers
        ):
            raise ConfigError(
                f"availability.offline.{name}: expected a list of rounds in 1..{rounds}, "
                f"got {numbers!r}"
            )
        trace[name] = tuple(numbers)
    return Availability(float(online), trace)


@dataclass(frozen=True)
class SimConfig:
    raw: dict[str, Any]
    profiles: tuple[Profile, ...]
    gpu_memory: int
    gpu_flops: float
    clients: int
    partition: dict[str, Any] = field(default_factory=dict)
    availability: Availability | None = None
    workers: int = 1
    measure_memory: bool = True
    batched: bool = False
    client_device: str = "cpu"

    @property
    def method(self) -> str:
        return str(self.raw["method"])


def _profiles(entries: object) -> tuple[Profile, ...]:
    if not isinstance(entries, list) or not entries:
        raise ConfigError("devices: expected a list of {profile, share, memory, flops, uplink}")
    profiles = []
    for index, entry in enumerate(entries):
        where = f"devices[{index}]"
        data = _expect_keys(entry, where, {"memory", "flops"}, {"profile", "share", "uplink"})
        share = data.get("share", 1.0 / len(entries))
        if isinstance(share, bool) or not isinstance(share, int | float) or not 0 < share <= 1:
            raise ConfigError(f"{where}.share: expected a fraction in (0, 1], got {share!r}")
        profiles.append(
            Profile(
                str(data.get("profile", f"profile-{index}")),
                float(share),
                parse_memory(data["memory"], f"{where}.memory"),
                parse_flops(data["flops"], f"{where}.flops"),
                parse_bandwidth(data.get("uplink", "100Mbit"), f"{where}.uplink"),
            )
        )
    if not math.isclose(sum(p.share for p in profiles), 1.0, abs_tol=1e-6):
        raise ConfigError(f"devices: shares must add up to 1, got {sum(p.share for p in profiles)}")
    return tuple(profiles)


def parse_sim_config(data: object, overrides: Mapping[str, Any] | None = None) -> SimConfig:
    fields = _expect_keys(data if data is not None else {}, "simulation config", set(), _KEYS)
    merged = {**DEFAULTS, **fields, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    method = merged["method"]
    if method not in METHODS and method not in BASELINES:
        raise ConfigError(f"method: {method!r} is not one of {[*METHODS, *BASELINES]}")
    clients = merged["clients"]
    if isinstance(clients, bool) or not isinstance(clients, int) or clients < 1:
        raise ConfigError(f"clients: expected an integer >= 1, got {clients!r}")
    part = _expect_keys(merged["partition"], "partition", {"kind"}, {"alpha", "per_client"})
    if part["kind"] not in PARTITIONS:
        raise ConfigError(f"partition.kind: {part['kind']!r} is not one of {list(PARTITIONS)}")
    gpu = _expect_keys(merged["gpu"], "gpu", {"memory", "flops"}, set())
    test_fraction = merged["test_fraction"]
    if not isinstance(test_fraction, int | float) or not 0 < test_fraction < 1:
        raise ConfigError(f"test_fraction: expected a fraction in (0, 1), got {test_fraction!r}")
    workers = merged.get("workers")
    workers = min(os.cpu_count() or 1, clients) if workers is None else workers
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise ConfigError(f"workers: expected an integer >= 1, got {workers!r}")
    measure = merged.get("measure_memory", True)
    if not isinstance(measure, bool):
        raise ConfigError(f"measure_memory: expected true or false, got {measure!r}")
    batched = merged.get("batched", False)
    if not isinstance(batched, bool):
        raise ConfigError(f"batched: expected true or false, got {batched!r}")
    device = merged.get("client_device", "cpu")
    if not isinstance(device, str) or not re.fullmatch(r"cpu|cuda(:\d+)?|mps", device):
        raise ConfigError(f"client_device: expected cpu, cuda, cuda:N or mps, got {device!r}")
    rounds = merged["rounds"]
    if isinstance(rounds, bool) or not isinstance(rounds, int) or rounds < 1:
        raise ConfigError(f"rounds: expected an integer >= 1, got {rounds!r}")
    config = SimConfig(
        raw=merged,
        profiles=_profiles(merged["devices"]),
        gpu_memory=parse_memory(gpu["memory"], "gpu.memory"),
        gpu_flops=parse_flops(gpu["flops"], "gpu.flops"),
        clients=clients,
        partition=part,
        availability=_availability(merged.get("availability"), clients, rounds),
        workers=workers,
        measure_memory=measure,
        batched=batched,
        client_device=device,
    )
    run_config(config, "check")  # the shared keys are validated by the run configuration
    return config


def load_sim_config(path: str | Path | None, overrides: Mapping[str, Any]) -> SimConfig:
    data = None
    if path is not None:
        try:
            data = yaml.safe_load(Path(path).read_text())
        except OSError as error:
            raise ConfigError(f"simulation config {str(path)!r} cannot be read: {error}") from error
        except yaml.YAMLError as error:
            raise ConfigError(
                f"simulation config {str(path)!r} is not valid YAML: {error}"
            ) from error
    return parse_sim_config(data, overrides)


def client_names(count: int) -> list[str]:
    return [f"client-{index:03d}" for index in range(count)]


def run_config(config: SimConfig, run_id: str, eval_data: str | None = None) -> RunConfig:
    raw = config.raw
    return RunConfig.parse(
        {
            "run_id": run_id,
            "model": raw["model"],
            "input_shape": list(raw["input_shape"]),
            "num_classes": raw["num_classes"],
            "eval_data": eval_data,
            "devices": {"edges": client_names(config.clients), "gpu_servers": 1, "wait": "60s"},
            "rounds": raw["rounds"],
            "local_epochs": raw["local_epochs"],
            "batch_size": raw["batch_size"],
            "optimizer": raw["optimizer"],
            "local_loss": raw["local_loss"],
            "mode": METHODS.get(raw["method"], "local-loss"),
            "compression": raw["compression"],
            "strategy": raw["strategy"],
            "round_deadline": 600,
            "seed": raw["seed"],
            "federated_eval": raw.get("federated_eval", 0.0),
        }
    )


def _profile_of(index: int, count: int, profiles: tuple[Profile, ...]) -> Profile:
    """Clients take profiles by share, in order (50% / 50% of 4: two of each)."""
    bounds = np.cumsum([p.share for p in profiles]) * count
    for profile, bound in zip(profiles, bounds, strict=True):
        if index < round(bound):
            return profile
    return profiles[-1]


def _data(config: SimConfig) -> tuple[Dataset, Dataset]:
    raw = config.raw
    data = load_dataset(raw["data"])
    if raw.get("test_data"):
        return data, load_dataset(raw["test_data"])
    return data.split(float(raw["test_fraction"]), seed=int(raw["seed"]))


class _Fleet(RoundObserver):
    """The simulated clients: agents on one host sharing a segment pool, taken offline and
    brought back before each round as the availability settings say (offline is real: the
    client's Flower node leaves, as a device that loses its connection does)."""

    def __init__(
        self,
        config: SimConfig,
        data: dict[str, Dataset],
        profiles: dict[str, Profile],
        connect: Callable[..., Transport],
    ) -> None:
        self.config, self.data, self.profiles, self.connect = config, data, profiles, connect
        self.pool: SegmentPool[Segment] = SegmentPool(
            config.workers,
            stacked=config.batched,
            capacity=config.clients,
            device=config.client_device,
        )
        self.coordinator: Coordinator | None = None
        self._agents: dict[str, tuple[EdgeAgent, Transport, Transport]] = {}
        self._generation = 0
        for name in data:
            self._start(name)

    def _start(self, name: str) -> None:
        self._generation += 1
        profile, suffix = self.profiles[name], f"-{self._generation}"
        control = self.connect(f"{name}-control{suffix}", node_will(node_id_for(name), name))
        stream = self.connect(f"{name}-stream{suffix}")
        announcement = Announcement(name, "edge", profile.memory, profile.flops, profile.uplink)
        agent = EdgeAgent(
            announcement, self.data[name], control, stream, measure_peak=False, source=self.pool
        )
        self._agents[name] = (agent, control, stream)

    def _stop(self, name: str) -> None:
        _agent, control, stream = self._agents.pop(name)
        control.kill()  # the broker publishes its will: the coordinator sees it leave
        stream.close()

    def round_starting(self, number: int) -> None:
        if self.config.availability is None:
            return
        names = list(self.data)
        offline = self.config.availability.offline_in(number, names, int(self.config.raw["seed"]))
        for name in names:
            if name in offline and name in self._agents:
                self._stop(name)
            elif name not in offline and name not in self._agents:
                self._start(name)
        log.info("round %d: %d of %d clients online", number, len(names) - len(offline), len(names))
        deadline = time.monotonic() + 30.0
        while self.coordinator is not None and time.monotonic() < deadline:
            if set(self.coordinator.online("edge")) == set(self._agents):
                return
            time.sleep(0.01)

    def close(self) -> None:
        for _agent, control, stream in self._agents.values():
            control.close()
            stream.close()


class _Observers(RoundObserver):
    """Tells several observers, in order."""

    def __init__(self, *observers: RoundObserver) -> None:
        self.observers = observers

    def round_starting(self, number: int) -> None:
        for observer in self.observers:
            observer.round_starting(number)

    def round_started(self, number: int, devices: list[str]) -> None:
        for observer in self.observers:
            observer.round_started(number, devices)

    def device_answered(self, device: str) -> None:
        for observer in self.observers:
            observer.device_answered(device)

    def round_committed(self, number: int, evaluation: dict[str, float], results: Any) -> None:
        for observer in self.observers:
            observer.round_committed(number, evaluation, results)


def _measure_peaks(config: SimConfig, edges: dict[str, Any]) -> dict[tuple[int, int], int | None]:
    """The real peak of each distinct client assignment, trained in a fresh process (one
    process hosts every client here, so per-client peaks cannot be told apart in it)."""
    raw = config.raw
    ranges = sorted({tuple(e["blocks"]) for e in edges.values()})

    def measure(blocks: tuple[int, int]) -> int | None:
        return measure_in_fresh_process(
            raw["model"],
            raw["input_shape"],
            raw["num_classes"],
            blocks[0],
            blocks[1],
            int(raw["batch_size"]),
            str(raw["optimizer"]["name"]),
            str(raw["local_loss"]),
            METHODS[config.method],
        )

    with ThreadPoolExecutor(max_workers=max(1, min(len(ranges), os.cpu_count() or 1))) as pool:
        return dict(zip(ranges, pool.map(measure, ranges), strict=True))


def simulate(
    config: SimConfig,
    out: Path,
    broker: str = "none",
    run_id: str | None = None,
    observer: RoundObserver | None = None,
) -> dict[str, Any]:
    """Run the simulation; write its outputs into ``out`` and return the summary.
    ``observer`` (a progress display) hears about every round."""
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    train, test = _data(config)
    if tuple(train.x.shape[1:]) != tuple(config.raw["input_shape"]):
        raise ConfigError(
            f"input_shape: the data has samples of shape {list(train.x.shape[1:])}, "
            f"the config says {list(config.raw['input_shape'])}"
        )
    test_path = out / "test.npz"
    np.savez(test_path, x=test.x, y=test.y)
    run_id = run_id or f"sim-{uuid.uuid4().hex[:8]}"
    run = run_config(config, run_id, f"npz:{test_path}")
    names = client_names(config.clients)
    parts = partition(
        train.y,
        config.clients,
        config.partition["kind"],
        alpha=float(config.partition.get("alpha", 0.5)),
        per_client=int(config.partition.get("per_client", 2)),
        seed=int(config.raw["seed"]),
    )
    if config.method in BASELINES:
        summary = _baseline(config, train, test, parts, names, out, run_id, started)
        write_outputs(out, summary, summary.pop("_plan_text"))
        return summary
    profiles = {
        name: _profile_of(index, config.clients, config.profiles)
        for index, name in enumerate(names)
    }
    connect, closer = _transports(broker)
    fleet = None
    try:
        gpu = Announcement("gpu-sim", "gpu", config.gpu_memory, config.gpu_flops)
        GpuAgent(
            gpu,
            connect("gpu-sim-control", node_will(gpu.node_id, "gpu-sim")),
            connect("gpu-sim-stream"),
        )
        data = {name: train.subset(rows) for name, rows in zip(names, parts, strict=True)}
        fleet = _Fleet(config, data, profiles, connect)
        observers = _Observers(fleet, *([observer] if observer is not None else []))
        with open_store(f"sqlite:///{out / 'runs.db'}") as store:
            coordinator = Coordinator(run, store, connect("coordinator"), observer=observers)
            fleet.coordinator = coordinator
            coordinator.run()
            trained = time.perf_counter()
            plan = store.get_run(run_id).plan or {}
            edges = {e["name"]: e for e in plan.get("edges", [])}
            measured = _measure_peaks(config, edges) if config.measure_memory else {}
            backprop = METHODS[config.method] == "backprop"
            rows = round_rows(store, run_id, edges, profiles, backprop)
            clients = client_rows(store, run_id, edges, profiles, measured)
    finally:
        if fleet is not None:
            fleet.close()
        closer()
    training = sum(r["wall_seconds"] or 0.0 for r in rows)
    summary = {
        "run_id": run_id,
        "method": config.method,
        "final_accuracy": rows[-1]["accuracy"] if rows else None,
        "total_wall_seconds": time.perf_counter() - started,
        "training_wall_seconds": training,
        "setup_wall_seconds": trained - started - training,
        "total_simulated_seconds": sum(r["simulated_seconds"] or 0.0 for r in rows),
        "workers": config.workers,
        "batched": fleet.pool.stack_counts if config.batched else None,
        "rounds": rows,
        "clients": clients,
    }
    write_outputs(out, summary, _plan_text(plan))
    return summary


def _plan_text(plan: dict[str, Any]) -> str:
    from split_models.plan import Plan

    if not plan:
        return "no plan"
    try:
        return str(Plan.from_dict(plan))
    except (KeyError, TypeError, ValueError):
        return json.dumps(plan, indent=2)


def _baseline(
    config: SimConfig,
    train: Dataset,
    test: Dataset,
    parts: list[np.ndarray],
    names: list[str],
    out: Path,
    run_id: str,
    started: float,
) -> dict[str, Any]:
    from simulation.baselines import run_baseline

    profiles = {
        name: _profile_of(index, config.clients, config.profiles)
        for index, name in enumerate(names)
    }
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        rows, clients, plan = run_baseline(
            config.method,
            config.raw,
            (train, test),
            dict(zip(names, parts, strict=True)),
            profiles,
            store,
            run_id,
        )
    return {
        "run_id": run_id,
        "method": config.method,
        "final_accuracy": rows[-1]["accuracy"] if rows else None,
        "total_wall_seconds": time.perf_counter() - started,
        "training_wall_seconds": sum(r["wall_seconds"] or 0.0 for r in rows),
        "total_simulated_seconds": sum(r["simulated_seconds"] or 0.0 for r in rows),
        "rounds": rows,
        "clients": clients,
        "_plan_text": plan,
    }


def _transports(broker: str) -> tuple[Any, Any]:
    if broker == "none":
        hub = InProcessHub()
        return (lambda name, will=None: hub.connect(name, will)), (lambda: None)
    from wire.broker import Broker
    from wire.mqtt import MqttConfig, MqttTransport

    started = Broker().start() if broker == "embedded" else None
    url = started.url if started is not None else broker
    made: list[MqttTransport] = []

    def connect(name: str, will: Will | None = None) -> Transport:
        config = MqttConfig.from_url(url, session_expiry=0, clean_start=True)
        made.append(MqttTransport(config, f"{name}-{uuid.uuid4().hex[:6]}", will))
        return made[-1]

    def close() -> None:
        for transport in made:
            transport.close()
        if started is not None:
            started.stop()

    return connect, close
