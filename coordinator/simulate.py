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

import csv
import json
import logging
import math
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from coordinator.config import RunConfig, _expect_keys
from coordinator.service import Coordinator
from edge_client.agent import EdgeAgent
from gpu_server.agent import GpuAgent
from split_models.data import PARTITIONS, Dataset, load_dataset, partition
from split_models.errors import ConfigError
from split_models.units import parse_bandwidth, parse_flops, parse_memory
from storage import open_store
from wire.flower import node_will
from wire.roles import Announcement, node_id_for
from wire.transport import InProcessHub, Transport, Will

__all__ = ["DEFAULTS", "METHODS", "SimConfig", "load_sim_config", "simulate"]

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
_KEYS = set(DEFAULTS) | {"test_data"}


@dataclass(frozen=True)
class Profile:
    name: str
    share: float
    memory: int
    flops: float
    uplink: float


@dataclass(frozen=True)
class SimConfig:
    raw: dict[str, Any]
    profiles: tuple[Profile, ...]
    gpu_memory: int
    gpu_flops: float
    clients: int
    partition: dict[str, Any] = field(default_factory=dict)

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
    config = SimConfig(
        raw=merged,
        profiles=_profiles(merged["devices"]),
        gpu_memory=parse_memory(gpu["memory"], "gpu.memory"),
        gpu_flops=parse_flops(gpu["flops"], "gpu.flops"),
        clients=clients,
        partition=part,
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


def simulate(
    config: SimConfig, out: Path, broker: str = "none", run_id: str | None = None
) -> dict[str, Any]:
    """Run the simulation; write its outputs into ``out`` and return the summary."""
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
        _write(out, summary, store_plan=summary.pop("_plan_text"))
        return summary
    connect, closer = _transports(broker)
    try:
        gpu = Announcement("gpu-sim", "gpu", config.gpu_memory, config.gpu_flops)
        GpuAgent(
            gpu,
            connect("gpu-sim-control", node_will(gpu.node_id, "gpu-sim")),
            connect("gpu-sim-stream"),
        )
        profiles = {}
        for index, (name, rows) in enumerate(zip(names, parts, strict=True)):
            profile = _profile_of(index, config.clients, config.profiles)
            profiles[name] = profile
            EdgeAgent(
                Announcement(name, "edge", profile.memory, profile.flops, profile.uplink),
                train.subset(rows),
                connect(f"{name}-control", node_will(node_id_for(name), name)),
                connect(f"{name}-stream"),
                measure_peak=False,
            )
        with open_store(f"sqlite:///{out / 'runs.db'}") as store:
            Coordinator(run, store, connect("coordinator")).run()
            summary = _summary(store, run_id, config, profiles, time.perf_counter() - started)
    finally:
        closer()
    _write(out, summary, store_plan=summary.pop("_plan_text"))
    return summary


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
    from coordinator.baselines import train_centralized, train_fedavg, whole_model_bytes
    from split_models.isolated import profile_in_fresh_process

    raw = config.raw
    need = flops = model_bytes = num_blocks = 0
    if config.method == "fedavg":  # centralized has no clients to size (and is not timed so)
        profile = profile_in_fresh_process(
            raw["model"],
            raw["input_shape"],
            raw["num_classes"],
            (raw["local_loss"],),
            raw["batch_size"],
        )
        need = whole_model_bytes(raw, profile)
        flops = sum(b.flops for b in profile.blocks)
        model_bytes = sum(b.param_bytes + b.buffer_bytes for b in profile.blocks)
        num_blocks = profile.num_blocks
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        if config.method == "centralized":
            train_centralized(raw, train, test, store, run_id)
            clients: list[dict[str, Any]] = []
        else:
            data = {n: train.subset(rows) for n, rows in zip(names, parts, strict=True)}
            train_fedavg(raw, data, test, store, run_id)
            clients = []
            for index, name in enumerate(names):
                profile_of = _profile_of(index, config.clients, config.profiles)
                examples = len(data[name]) * int(raw["local_epochs"]) * int(raw["rounds"])
                clients.append(
                    {
                        "name": name,
                        "profile": profile_of.name,
                        "blocks": [0, num_blocks],
                        "budget_bytes": profile_of.memory,
                        "estimated_peak_bytes": need,
                        "fits": need <= profile_of.memory,
                        "measured_peak_bytes": None,
                        "bytes_up": model_bytes * int(raw["rounds"]),
                        "bytes_down": model_bytes * int(raw["rounds"]),
                        "cut_bytes_up": 0,
                        "cut_bytes_down": 0,
                        "examples": examples,
                    }
                )
        rows = []
        for record in store.list_rounds(run_id):
            simulated = None
            if config.method == "fedavg":
                simulated = max(
                    max(
                        3 * len(data[n]) * int(raw["local_epochs"]) * flops / p.flops,
                        model_bytes / p.uplink,
                    )
                    for n, p in (
                        (n, _profile_of(i, config.clients, config.profiles))
                        for i, n in enumerate(names)
                    )
                )
            rows.append(
                {
                    "round": record.number,
                    "accuracy": record.evaluation.get("accuracy"),
                    "loss": record.evaluation.get("loss"),
                    "bytes_up": model_bytes * len(clients),
                    "bytes_down": model_bytes * len(clients),
                    "wall_seconds": record.metrics.get("wall_seconds"),
                    "simulated_seconds": simulated,
                }
            )
    unfit = [c["name"] for c in clients if not c["fits"]]
    plan = (
        "centralized: one process, the whole model, pooled data"
        if config.method == "centralized"
        else f"fedavg: the whole model ({num_blocks} blocks, estimated "
        f"{need} bytes to train) on every client"
        + (f"; it does not fit {', '.join(unfit)}" if unfit else "")
    )
    return {
        "run_id": run_id,
        "method": config.method,
        "final_accuracy": rows[-1]["accuracy"] if rows else None,
        "total_wall_seconds": time.perf_counter() - started,
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


def _summary(
    store: Any, run_id: str, config: SimConfig, profiles: dict[str, Profile], wall: float
) -> dict[str, Any]:
    from split_models.plan import Plan

    run = store.get_run(run_id)
    rounds = store.list_rounds(run_id)
    plan = run.plan or {}
    blocks = {e["name"]: e for e in plan.get("edges", [])}
    rows = []
    for record in rounds:
        rows.append(
            {
                "round": record.number,
                "accuracy": record.evaluation.get("accuracy"),
                "loss": record.evaluation.get("loss"),
                "bytes_up": sum(r.bytes_sent for r in record.results),
                "bytes_down": sum(r.bytes_received for r in record.results),
                "wall_seconds": record.metrics.get("wall_seconds"),
                "simulated_seconds": _simulated_round(record, blocks, profiles),
            }
        )
    clients = []
    for name, profile in profiles.items():
        edge = blocks.get(name, {})
        results = [r for record in rounds for r in record.results if r.device == name]
        clients.append(
            {
                "name": name,
                "profile": profile.name,
                "blocks": edge.get("blocks"),
                "budget_bytes": profile.memory,
                "estimated_peak_bytes": edge.get("estimated_peak_bytes"),
                "measured_peak_bytes": None,  # one process hosts every client: not separable
                "bytes_up": sum(r.bytes_sent for r in results),
                "bytes_down": sum(r.bytes_received for r in results),
                "examples": sum(r.examples for r in results),
            }
        )
    try:
        plan_text = str(Plan.from_dict(plan)) if plan else "no plan"
    except (KeyError, TypeError, ValueError):
        plan_text = json.dumps(plan, indent=2)
    return {
        "run_id": run_id,
        "method": config.method,
        "final_accuracy": rows[-1]["accuracy"] if rows else None,
        "total_wall_seconds": wall,
        "total_simulated_seconds": sum(r["simulated_seconds"] or 0.0 for r in rows),
        "rounds": rows,
        "clients": clients,
        "_plan_text": plan_text,
    }


def _simulated_round(record: Any, blocks: dict[str, Any], profiles: dict[str, Profile]) -> float:
    """What the round would take on the declared devices: each client computes its prefix
    (3x forward FLOPs per sample) and uploads its cut, overlapped; the slowest client bounds
    the round (the GPU server is taken to keep up)."""
    slowest = 0.0
    for result in record.results:
        edge, profile = blocks.get(result.device), profiles.get(result.device)
        if edge is None or profile is None or result.failure:
            continue
        compute = 3 * result.examples * edge["flops_per_sample"] / profile.flops
        upload = result.examples * edge["cut_bytes_per_sample"] / profile.uplink
        slowest = max(slowest, compute, upload)
    return slowest


def _write(out: Path, summary: dict[str, Any], store_plan: str) -> None:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "plan.txt").write_text(store_plan + "\n")
    with (out / "rounds.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(
            handle, fieldnames=list(summary["rounds"][0]) if summary["rounds"] else ["round"]
        )
        writer.writeheader()
        writer.writerows(summary["rounds"])
