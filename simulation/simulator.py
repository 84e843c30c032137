"""``edgesplit simulate``: the coordinator, a GPU server and N edge clients in one process, on
the same code paths as a deployment (agents, Flower messages, credits, the SQL store).

The transport is in-process by default; ``--broker embedded`` starts a private mosquitto and
``--broker mqtt://...`` uses a running one. Clients get heterogeneous device profiles (memory,
FLOP/s, uplink) mixed by share; the plan respects each client's memory. Results go to
``--out``: ``summary.json``, ``rounds.csv``, ``plan.txt`` and the run store ``runs.db``
(so ``edgesplit status`` and ``edgesplit export`` work on a simulation).

The configuration is ``simulation.config.SimConfig`` (SIM.yaml); without ``--config`` its
defaults run on scikit-learn's bundled digits, offline.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from coordinator.config import RunConfig
from coordinator.planner import stored_plan
from coordinator.service import Coordinator, RoundObserver
from edge_client.agent import EdgeAgent
from gpu_server.agent import GpuAgent
from simulation.baselines import ignored_by_baseline, model_profile, run_baseline
from simulation.config import (
    BASELINES,
    GPU_NAME,
    Profile,
    SimConfig,
    client_names,
    run_config,
)
from simulation.hosts import ClientGroup, HostAgent
from simulation.pool import SegmentPool
from simulation.report import client_rows, majority_share, round_rows, write_outputs
from simulation.resume import fingerprint, run_id_for, started_run
from simulation.shield import HeldSignals, held_signals
from split_models.data import (
    Dataset,
    load_dataset,
    model_data_problem,
    partition,
    scale_warning,
    shaped_for,
)
from split_models.errors import ConfigError
from split_models.measure import measure_in_fresh_process
from split_models.plan import EdgeAssignment, Plan
from split_models.runtime import require_device
from split_models.segment import Segment
from storage import open_store
from wire.errors import TransportError
from wire.flower import FlowerNode, node_will
from wire.roles import Announcement, node_id_for
from wire.transport import InProcessHub, Transport

__all__ = ["simulate"]

log = logging.getLogger(__name__)


def _partition(config: SimConfig, train: Dataset) -> list[np.ndarray]:
    split = config.fleet.partition
    return partition(
        train.y,
        config.fleet.clients,
        split.kind,
        alpha=split.alpha,
        per_client=split.per_client,
        seed=config.training.seed,
    )


def _data(config: SimConfig) -> tuple[Dataset, Dataset]:
    shape = tuple(config.model.input_shape)
    data = shaped_for(load_dataset(config.data.data), shape)
    if config.data.test_data:
        return data, shaped_for(load_dataset(config.data.test_data), shape)
    return data.split(config.data.test_fraction, seed=config.training.seed)


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
        fleet = config.fleet
        self.pool: SegmentPool[Segment] = SegmentPool(
            fleet.worker_count,
            stacked=fleet.batched,
            capacity=fleet.clients,
            device=fleet.client_device,
            interleave=fleet.interleave,
        )
        self.coordinator: Coordinator | None = None
        self._agents: dict[str, tuple[EdgeAgent, Transport, Transport]] = {}
        self._generation = 0
        self._offline: set[str] = set()  # grouped clients the availability takes offline
        if fleet.group_clients:
            for index, (name, (profile, clients)) in enumerate(fleet.hosts().items()):
                self._start_host(index, name, profile, clients)
            return
        for name in data:
            self._start(name)

    def _start_host(self, index: int, name: str, profile: Profile, clients: list[str]) -> None:
        """A host agent training ``clients`` (simulation.hosts), online for the whole run."""
        ends = np.cumsum([len(self.data[c]) for c in clients])
        spans = [(end - len(self.data[c]), end) for c, end in zip(clients, ends, strict=True)]
        group = ClientGroup(tuple(clients), tuple(np.arange(*span) for span in spans))
        data = Dataset(
            np.concatenate([self.data[c].x for c in clients]),
            np.concatenate([self.data[c].y for c in clients]),
            self.data[clients[0]].num_classes,
        )
        for client, (start, end) in zip(clients, spans, strict=True):  # views: one copy held
            self.data[client] = Dataset(data.x[start:end], data.y[start:end], data.num_classes)
        control = self.connect(f"{name}-control", node_will(node_id_for(name), name))
        stream = self.connect(f"{name}-stream")
        announcement = Announcement(name, "edge", profile.memory, profile.flops, profile.uplink)
        agent = HostAgent(
            announcement,
            data,
            control,
            stream,
            measure_peak=False,
            models=(self.config.model.name,),
            group=group,
            choose=lambda number, names: self._choose(index, number, names),
            interleave=self.config.fleet.interleave,
        )
        self._agents[name] = (agent, control, stream)

    def _choose(self, host: int, number: int, names: Sequence[str]) -> list[str]:
        """The grouped clients of a host that train round ``number``: ``fraction_train`` of
        those online (at least one), drawn from the run's seed, in name order."""
        online = [n for n in names if n not in self._offline]
        fraction = float(self.config.aggregation.options.get("fraction_train", 1.0))
        count = min(len(online), max(1, int(len(online) * fraction)))
        rng = np.random.default_rng([self.config.training.seed, number, host])
        return sorted(rng.choice(online, count, replace=False).tolist()) if online else []

    def _start(self, name: str) -> None:
        self._generation += 1
        profile, suffix = self.profiles[name], f"-{self._generation}"
        control = self.connect(f"{name}-control{suffix}", node_will(node_id_for(name), name))
        stream = self.connect(f"{name}-stream{suffix}")
        announcement = Announcement(name, "edge", profile.memory, profile.flops, profile.uplink)
        agent = EdgeAgent(
            announcement,
            self.data[name],
            control,
            stream,
            measure_peak=False,
            source=self.pool,
            models=(self.config.model.name,),
        )
        self._agents[name] = (agent, control, stream)

    def _stop(self, name: str) -> None:
        _agent, control, stream = self._agents.pop(name)
        control.kill()  # the broker publishes its will: the coordinator sees it leave
        stream.close()

    def round_starting(self, number: int) -> None:
        availability = self.config.fleet.availability
        if availability is None:
            return
        names = list(self.data)
        offline = availability.offline_in(number, names, self.config.training.seed)
        log.info("round %d: %d of %d clients online", number, len(names) - len(offline), len(names))
        if self.config.fleet.group_clients:  # the hosts stay online, their clients do not
            self._offline = offline
            return
        for name in names:
            if name in offline and name in self._agents:
                self._stop(name)
            elif name not in offline and name not in self._agents:
                self._start(name)
        deadline = time.monotonic() + 30.0
        while self.coordinator is not None and time.monotonic() < deadline:
            if set(self.coordinator.online("edge")) == set(self._agents):
                return
            time.sleep(0.01)

    def round_started(self, number: int, devices: list[str]) -> None:
        """The round's clients take the pool's training slots in name order."""
        self.pool.expect(d for d in devices if d in self._agents)

    def close(self) -> None:
        for agent, control, stream in self._agents.values():
            _leave(agent.node)
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

    def round_committed(
        self,
        number: int,
        evaluation: dict[str, float],
        results: Any,
        servers: Sequence[str] = (),
        clients: int | None = None,
    ) -> None:
        for observer in self.observers:
            observer.round_committed(number, evaluation, results, servers, clients)


def _measure_peaks(
    config: SimConfig, edges: dict[str, EdgeAssignment]
) -> dict[tuple[int, int], int | None]:
    """The real peak of each distinct client assignment, trained in a fresh process (one
    process hosts every client here, so per-client peaks cannot be told apart in it)."""
    model, training = config.model, config.training
    ranges = sorted({e.blocks for e in edges.values()})

    def measure(blocks: tuple[int, int]) -> int | None:
        return measure_in_fresh_process(
            model,
            blocks[0],
            blocks[1],
            training.batch_size,
            training.optimizer.name,
            training.local_loss,
            training.mode,
        )

    with ThreadPoolExecutor(max_workers=max(1, min(len(ranges), os.cpu_count() or 1))) as pool:
        return dict(zip(ranges, pool.map(measure, ranges), strict=True))


def simulate(
    config: SimConfig,
    out: Path,
    broker: str = "none",
    run_id: str | None = None,
    observer: RoundObserver | None = None,
    password: str | None = None,
    allow_config_change: bool = False,
) -> dict[str, Any]:
    """Run the simulation; write its outputs into ``out`` and return the summary.
    ``observer`` (a progress display) hears about every round; ``password`` is the account's
    when ``broker`` names one without its password; ``allow_config_change``: a cancelled run
    in ``out`` whose training settings differ is resumed with the new ones (an event)."""
    started = time.perf_counter()
    out.mkdir(parents=True, exist_ok=True)
    train, test = _data(config)
    _check_data(config, train, test)
    test_path = out / "test.npz"
    np.savez(test_path, x=test.x, y=test.y)
    parts = _partition(config, train)
    baseline = config.method in BASELINES  # the whole model: never resumed, nothing to digest
    prints = None if baseline else fingerprint(train, parts, config.fleet.client_profiles())
    run_id = run_id or run_id_for(config, out, f"npz:{test_path}", prints, allow_config_change)
    run = run_config(config, run_id, f"npz:{test_path}")
    with held_signals() as held:  # from the run's end until its outputs are written
        if prints is None:
            summary = _baseline(
                config, (train, test), parts, out, (run_id, held, observer), started
            )
            summary["test_majority_share"] = majority_share(test)
            write_outputs(out, summary, summary.pop("_plan_text"))
            return summary
        names = client_names(config.fleet.clients)
        data = {name: train.subset(rows) for name, rows in zip(names, parts, strict=True)}
        del train  # the clients' rows are all that is held from here: the data once, not twice
        trained = _split_learning(
            config,
            (run, prints, allow_config_change),
            data,
            out,
            (broker, password),
            (observer, held),
        )
        summary = _summary(config, run_id, started, trained)
        summary["test_majority_share"] = majority_share(test)
        write_outputs(out, summary, _plan_text(trained[1]))
    return summary


_Rows = list[dict[str, Any]]
# when training ended, the stored plan, rows of the rounds trained now and of all, clients, batched
_Trained = tuple[float, Plan | None, _Rows, _Rows, _Rows, Any]


def _summary(config: SimConfig, run_id: str, started: float, trained: _Trained) -> dict[str, Any]:
    """The summary of a split-learning run started at ``started``: ``trained`` is what
    :func:`_split_learning` returned."""
    ended, _, now, rows, clients, batched = trained
    training = sum(r["wall_seconds"] or 0.0 for r in now)  # this process's rounds
    summary = {
        "run_id": run_id,
        "method": config.method,
        "final_accuracy": rows[-1]["accuracy"] if rows else None,
        "total_wall_seconds": time.perf_counter() - started,
        "training_wall_seconds": training,
        "setup_wall_seconds": ended - started - training,
        "total_simulated_seconds": sum(r["simulated_seconds"] or 0.0 for r in rows),
        "workers": config.fleet.worker_count,
        "batched": batched,
        "rounds": rows,
        "clients": clients,
    }
    if config.fleet.group_clients:  # the devices are hosts: how many clients each holds
        summary["hosts"] = {host: len(names) for host, (_, names) in config.fleet.hosts().items()}
    return summary


def _check_data(config: SimConfig, *sets: Dataset) -> None:
    """Data the model cannot take (no samples, samples of another shape, labels it has no
    output for, token ids outside its range): named before anything is planned or trained."""
    held_out = "test_data" if config.data.test_data else "data (its held-out test share)"
    for name, data in zip(("data", held_out), sets, strict=False):
        if problem := model_data_problem(data, config.model, name):
            raise ConfigError(problem)
        if warning := scale_warning(data, name):
            log.warning("%s", warning)


def _split_learning(
    config: SimConfig,
    started: tuple[RunConfig, dict[str, str], bool],
    data: dict[str, Dataset],
    out: Path,
    broker: tuple[str, str | None],
    watch: tuple[RoundObserver | None, HeldSignals],
) -> _Trained:
    """Train the run of ``started`` (config, digests, whether its training settings may have
    changed) on the simulated fleet (store in ``out``, ``broker`` URL and password, ``watch``
    the observer and the signals held after the run); return what :data:`_Trained` lists."""
    require_device(config.fleet.client_device, "client_device")
    require_device(config.gpu.device, "gpu.device")
    profiles = config.fleet.device_profiles()
    observer, held = watch
    connect, closer = _transports(*broker)
    fleet = gpu = None
    try:
        gpu = _start_gpu_host(config, connect)
        fleet = _Fleet(config, data, profiles, connect)
        observers = _Observers(fleet, *([observer] if observer is not None else []))
        run, prints, allow_config_change = started
        with open_store(f"sqlite:///{out / 'runs.db'}") as store:
            with started_run(store, run, prints):  # a new run is created with its digests
                coordinator = Coordinator(
                    run,
                    store,
                    connect("coordinator"),
                    observer=observers,
                    profile=lambda run: model_profile(run.model, run.training),
                    allow_config_change=allow_config_change,
                )
            fleet.coordinator = coordinator
            ran = coordinator.run()  # rounds trained now (a resumed run had others before)
            held.hold()  # finished: a new command would start a new run, so write its outputs
            trained = time.perf_counter()
            plan = stored_plan(store.get_run(run.run_id))
            edges = {e.name: e for e in plan.edges} if plan is not None else {}
            measured = _measure_peaks(config, edges) if config.fleet.measure_memory else {}
            backprop = config.training.mode == "backprop"
            rows = round_rows(store, run.run_id, edges, profiles, backprop, _largest(config, data))
            clients = client_rows(store, run.run_id, edges, profiles, measured)
        batched = fleet.pool.stack_counts if config.fleet.batched else None
    finally:
        if fleet is not None:
            fleet.close()
        if gpu is not None:
            _leave(gpu.node)
        closer()
    return trained, plan, rows[len(rows) - ran :], rows, clients, batched


def _largest(config: SimConfig, data: dict[str, Dataset]) -> dict[str, int]:
    """Each host's examples a round of its largest client (grouped clients; else none)."""
    if not config.fleet.group_clients:
        return {}
    epochs = config.training.local_epochs
    return {
        host: epochs * max(len(data[c]) for c in clients)
        for host, (_, clients) in config.fleet.hosts().items()
    }


def _start_gpu_host(config: SimConfig, connect: Callable[..., Transport]) -> GpuAgent:
    """The simulation's GPU server, training on ``gpu.device``."""
    gpu = Announcement(
        GPU_NAME, "gpu", config.gpu.memory, config.gpu.flops, accelerator=config.gpu.device
    )
    return GpuAgent(
        gpu,
        connect(f"{GPU_NAME}-control", node_will(gpu.node_id, GPU_NAME)),
        connect(f"{GPU_NAME}-stream"),
        models=(config.model.name,),
    )


def _leave(node: FlowerNode) -> None:
    """Say ``node`` left (a retained ``offline``): on a broker, a simulation's devices must
    not look online to a coordinator after it ended."""
    with contextlib.suppress(TransportError):  # the broker went first: its will says it
        node.leave()


def _plan_text(plan: Plan | None) -> str:
    return "no plan" if plan is None else str(plan)


def _baseline(
    config: SimConfig,
    data: tuple[Dataset, Dataset],
    parts: list[np.ndarray],
    out: Path,
    run: tuple[str, HeldSignals, RoundObserver | None],
    started: float,
) -> dict[str, Any]:
    if config.fleet.availability is not None:
        log.warning(
            "availability applies to the split methods; every %s client stays online", config.method
        )
    if ignored := ignored_by_baseline(config):
        log.warning("%s trains the whole model: it ignores %s", config.method, ", ".join(ignored))
    run_id, held, observer = run
    with open_store(f"sqlite:///{out / 'runs.db'}") as store:
        rows, clients, plan = run_baseline(config, data, parts, store, run_id, observer)
        held.hold()  # a baseline is never resumed: its outputs are written before it stops
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


_VIEWS_PER_CONNECTION = 128  # docs/benchmarks.md, "Simulation over a broker at scale"


def _transports(broker: str, password: str | None) -> tuple[Any, Any]:
    """``connect(name, will)`` and ``close()``: an in-process hub, or logical clients sharing
    a few connections to the broker (one each would cost every client a socket and threads)."""
    if broker == "none":
        hub = InProcessHub()
        return (lambda name, will=None: hub.connect(name, will)), (lambda: None)
    from wire.broker import Broker
    from wire.mqtt import MqttConfig
    from wire.shared import SharedMqtt

    started = Broker().start() if broker == "embedded" else None
    url = started.url if started is not None else broker
    config = MqttConfig.from_url(url, password, session_expiry=0, clean_start=True)
    shared = SharedMqtt(config, _VIEWS_PER_CONNECTION)

    def close() -> None:
        shared.close()
        if started is not None:
            started.close()

    return shared.connect, close
