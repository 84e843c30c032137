"""The coordinator service: one run from device discovery to the last committed round.

1. Create the run in the store, or resume it (same run id, committed rounds): its last
   committed weights become the starting point and only the remaining rounds run. Each process
   announces a new session id (retained, :mod:`wire.session`), so devices still waiting inside
   a round of a crashed predecessor give it up instead of waiting for its deadline.
2. Wait for the declared devices (:class:`~coordinator.devices.DeviceRegistry`): each
   announces its capabilities (retained) and keeps a Flower node online; after
   ``devices.wait`` the coordinator stops with a message naming who is missing.
3. Plan (:class:`~coordinator.planner.Planner`): profile the model in a fresh process, split
   it over the devices' memory and speed, ask every edge whether it accepts its blocks and
   plan again without the ones that refuse. A resumed run keeps its stored plan while all its
   devices are online.
4. Rounds (:class:`~coordinator.runner.RoundRunner`): the Flower strategy samples the edges;
   each edge and the GPU server get a ``train`` message with their blocks' weights, the
   strategy's config and their :class:`~wire.roles.Task`. The round commits
   (:class:`~coordinator.recorder.RoundRecorder`) with the edges that finished if every piece
   of the back answered and at least ``min_train_nodes`` edges did (default 1); otherwise it
   is retried, up to ``max_attempts`` times.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import signal
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import FedAvg

from coordinator.aggregation import configured_strategy, is_robust
from coordinator.assignments import build_message, build_task, route, span
from coordinator.config import RunConfig
from coordinator.devices import DeviceRegistry, record_devices
from coordinator.errors import CoordinatorError, RunCancelled
from coordinator.lease import RunLease
from coordinator.moves import MovedEdges
from coordinator.planner import Placement, Planner
from coordinator.recorder import (
    WEIGHTS_SEGMENT,
    Evaluate,
    RoundObserver,
    RoundRecorder,
    device_records,
    round_problem,
)
from coordinator.resumption import create_or_check, first_try, record_take_over, resume_state
from coordinator.runner import RoundRunner, RoundWork, Settle
from coordinator.speed import Replanner
from coordinator.statistics import Recalibration
from coordinator.stopping import StopWatch, mark_cancelled
from split_models.data import Dataset, load_dataset, model_data_problem, shaped_for
from split_models.errors import ConfigError, SplitError
from split_models.evaluation import evaluate_weights
from split_models.isolated import profile_in_fresh_process
from split_models.mirror import head_mirrors
from split_models.profiler import ModelProfile
from split_models.randomness import apart
from split_models.segment import Segment
from split_models.weights import in_dtypes_of, norm_keys, segment_state
from split_models.zoo import SplittableModel
from storage.base import RunStore
from storage.errors import StoreError, UnreachableError
from storage.records import Event
from wire.errors import TransportError
from wire.flower import TransportGrid, array_record, attempt_of, numpy_arrays, round_of
from wire.roles import Announcement
from wire.session import SessionGuard, new_session
from wire.transport import Transport

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "RoundObserver",
    "RunCancelled",
    "evaluate_weights",
    "initial_weights",
]

log = logging.getLogger(__name__)


def initial_weights(
    model: SplittableModel,
    local_loss: str,
    cuts: Sequence[int],
    seed: int,
    known: Collection[str] = (),
) -> dict[str, np.ndarray]:
    """The blocks of ``model`` (built from ``seed``) and a local head for every cut, but the
    cuts whose head is among the ``known`` tensors (a resumed run's: building a head runs the
    model, seconds of a restart in a fresh process)."""
    weights = segment_state(Segment.from_model(model, 0, model.num_blocks))
    have = {key.partition(".")[0] for key in known}
    for cut in sorted(set(cuts) - {c for c in cuts if f"head{c}" in have}):
        with apart():  # seeded apart from a simulation's training threads
            torch.manual_seed(seed * 1000 + cut)
            head = Segment.from_model(model, 0, cut, local_loss)
        weights |= {k: v for k, v in segment_state(head).items() if k.startswith("head")}
    return weights


def head_cuts(placement: Placement) -> list[int]:
    """The cuts with a local head: every edge's, and a chained piece's before the last."""
    last = placement.plan.num_blocks
    return [a.end for a in placement.edges] + [b.end for b in placement.servers if b.end < last]


def with_heads(
    config: RunConfig, placement: Placement, weights: dict[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``weights`` with fresh local heads for the cuts of a new ``placement`` that have none."""
    training = config.training
    model = config.model.build(seed=training.seed)
    fresh = initial_weights(
        model, training.local_loss, head_cuts(placement), training.seed, weights
    )
    return fresh | weights


def local_keys(config: RunConfig, model: SplittableModel) -> frozenset[str]:
    """The tensors each device keeps as its own: the BatchNorm layers with ``norm: local``."""
    if config.training.norm != "local":
        return frozenset()
    return frozenset(norm_keys(Segment.from_model(model, 0, model.num_blocks)))


def _strategy(config: RunConfig) -> tuple[FedAvg, int]:
    """The configured split-aware strategy and the edges a round needs."""
    evaluate = 1.0 if config.training.federated_eval > 0 else 0.0
    return configured_strategy(config.aggregation.name, config.aggregation.options, evaluate)


class Coordinator:
    """Runs ``config`` against the devices reachable through ``transport``."""

    def __init__(
        self,
        config: RunConfig,
        store: RunStore,
        transport: Transport,
        max_attempts: int = 3,
        profile: Callable[[RunConfig], ModelProfile] | None = None,
        observer: RoundObserver | None = None,
        allow_config_change: bool = False,
        profile_cache: Path | None = None,
    ) -> None:
        """``observer``: told when a round starts, as each device answers and when a round
        commits (progress displays, simulated availability). ``allow_config_change``: a
        resumed run may train on with changed settings (recorded as an event).
        ``profile_cache``: a folder keeping model profiles across processes
        (:func:`~split_models.isolated.profile_in_fresh_process`)."""
        self.config, self.store, self.transport = config, store, transport
        self.allow_config_change = allow_config_change
        self.observer = observer or RoundObserver()
        self.grid = TransportGrid(transport)
        self._guard: SessionGuard | None = None
        self.session = new_session()  # devices drop work an earlier process asked for
        self.strategy, self.min_edges = _strategy(config)
        self.devices = DeviceRegistry(transport, self.grid)
        profile = profile or functools.partial(_profile_fresh, cache=profile_cache)
        self.planner = Planner(config, store, self.grid, self.session, profile, self.min_edges)
        self.replanner = Replanner(self.planner, store, config.devices.replan_drift)
        self.moves = MovedEdges(config.training)  # an edge's first round at a new cut
        shape = tuple(config.model.input_shape)
        eval_data = (
            shaped_for(load_dataset(config.data.eval_data), shape)
            if config.data.eval_data
            else None
        )
        evaluate = _central(config, eval_data) if eval_data is not None else None
        recorder = RoundRecorder(
            store, config.run_id, self.strategy, self.observer, evaluate, config.training.rounds
        )
        training = config.training
        self.runner = RoundRunner(
            self.grid,
            self.strategy,
            recorder,
            training.seed,
            training.round_deadline_seconds,
            max_attempts,
            self.min_edges,
        )

    @property
    def refusals(self) -> dict[str, str]:
        """Edges that refused their blocks while planning, with their reasons."""
        return self.planner.refusals

    def online(self, role: str | None = None) -> dict[str, Announcement]:
        """Announced devices whose Flower node is online."""
        return self.devices.online(role)

    def run(self, lease: RunLease | None = None) -> int:
        """Train the run to its configured rounds; return the number of rounds run now.
        Interrupted (Ctrl-C, a signal the caller turned into ``KeyboardInterrupt``) or asked to
        stop (``edgesplit runs stop``), it marks the run ``cancelled`` and raises
        :class:`RunCancelled`; the same call later resumes it. ``lease``: the run's lease,
        taken by the caller before it connected to the broker; without one the call takes it
        (:class:`~coordinator.errors.RunHeldError` while another coordinator drives the run)
        and gives it up at the end."""
        own = lease is None
        lease = lease or RunLease(self.store, self.config.run_id).acquire()
        try:
            create_or_check(self.store, self.config, self.allow_config_change)
            record_take_over(self.store, lease)
            with StopWatch(self.store, self.config.run_id) as watch:
                self.runner.stop_check = functools.partial(_checks, watch, lease)
                return self._train()
        except KeyboardInterrupt as stop:
            raise self._cancelled(stop) from None
        except (CoordinatorError, SplitError, StoreError, TransportError):
            raise  # recorded where raised, or the store or broker: it resumes once they are back
        except Exception as error:  # a bug, or the user's model failing mid-round: said
            with contextlib.suppress(StoreError):
                why = f"unexpected {type(error).__name__}: {error}"[:500]
                _failed(self.store, self.config.run_id, why)
            _say_ended(self._guard)
            raise
        finally:
            if own:
                lease.release()

    def _cancelled(self, stop: KeyboardInterrupt) -> RunCancelled:
        """Mark the run cancelled; the exception that says so."""
        requested = isinstance(stop, RunCancelled) and stop.requested
        signum = getattr(stop, "signum", None) or signal.SIGINT
        why = (
            "stop requested by edgesplit runs stop"
            if requested
            else f"interrupted by {signal.Signals(signum).name}"
        )
        # first the store (which refuses a coordinator whose run was taken over), then the
        # devices give up the round under way at once
        _record_stop(self.store, self.config.run_id, why)
        _say_ended(self._guard)
        log.info("run %s cancelled: %s", self.config.run_id, why)
        return RunCancelled(
            f"run {self.config.run_id} cancelled ({why}); run the same command again to resume",
            requested,
            None if requested else signum,
        )

    def _train(self) -> int:
        config, store = self.config, self.store
        # Before any message: devices still inside a round of a crashed predecessor give it up.
        guard = self._guard = SessionGuard(self.transport, config.run_id, self.session)
        guard.start()
        self.runner.on_attempt = guard.attempt
        self.grid.on_train_error = _out_on_error(guard)
        # the run's one coordinator: files a killed predecessor was committing are garbage
        if discarded := store.discard_pending(config.run_id):
            log.info("removed %d checkpoint file(s) of an unfinished commit", discarded)
        resumed = resume_state(store, config.run_id)
        done = 0 if resumed is None else resumed.round.number
        if done >= config.training.rounds:
            store.set_run_status(config.run_id, "finished")
            log.info("run %s already has all %d rounds", config.run_id, config.training.rounds)
            return 0
        self.runner.first_try[done + 1] = first_try(store, config.run_id, done + 1)
        store.set_run_status(config.run_id, "planning")
        placement = self._placement(resumed is not None)
        cuts = head_cuts(placement)
        model = config.model.build(seed=config.training.seed)
        stored = {} if resumed is None else resumed.weights[WEIGHTS_SEGMENT]
        seed = config.training.seed
        fresh = initial_weights(model, config.training.local_loss, cuts, seed, stored)
        weights = fresh | in_dtypes_of(fresh, stored)
        self.runner.recorder.keep_local(
            local_keys(config, model), None if resumed is None else resumed.weights
        )
        self.runner.recorder.take_up(resumed, weights)
        store.set_run_status(config.run_id, "training")
        try:
            for number in range(done + 1, config.training.rounds + 1):
                weights, placement = self._round(number, weights, placement)
                if number < config.training.rounds:
                    placement, weights = self._replan(number, placement, weights)
        except CoordinatorError as error:
            _failed(store, config.run_id, str(error))  # refused once the run is another's
            _say_ended(guard)
            raise
        store.set_run_status(config.run_id, "finished")
        _say_ended(guard)  # a replayed task of this session is work nobody waits for
        return config.training.rounds - done

    def _replan(
        self, number: int, placement: Placement, weights: dict[str, np.ndarray]
    ) -> tuple[Placement, dict[str, np.ndarray]]:
        """The placement for the next round (a new one when round ``number``'s measured
        speeds call for it: its new cuts get fresh local heads)."""
        new = self.replanner.after_round(number, placement, self.runner.reported, self.online())
        if new is None:
            return placement, weights
        self.runner.recorder.replanned(new.spans())
        return new, with_heads(self.config, new, weights)

    def _placement(self, resumed: bool) -> Placement:
        """The stored plan of a resumed run if it still holds, else a new plan (stored)."""
        config, store = self.config, self.store
        try:
            edges, servers = self.devices.wait(config.devices)
            record_devices(store, [*edges, *servers])
            if resumed:  # the speeds measured before the restart, kept plan or not
                self.replanner.restore(store.get_run(config.run_id).plan)
            kept = self.planner.stored(edges, servers) if resumed else None
            placement = kept or self.planner.plan(*self.replanner.believed_of(edges, servers))
        except (CoordinatorError, SplitError) as error:
            store.set_run_status(config.run_id, "failed")
            store.add_event(config.run_id, Event("planning-failed", str(error)))
            raise
        if kept is None:
            record = self.planner.record(placement.plan) | self.replanner.measured()
            store.set_plan(config.run_id, record)
            store.add_event(config.run_id, Event("planned", f"cuts {placement.plan.cuts()}"))
            log.info("plan:\n%s", placement.plan)
            placement = self.replanner.before_first_round(placement, self.online()) or placement
        return placement

    def _round(
        self, number: int, weights: dict[str, np.ndarray], placement: Placement
    ) -> tuple[dict[str, np.ndarray], Placement]:
        """Round ``number`` from ``weights`` through the runner; its weights and placement."""
        now = (placement, weights)

        def prepare(number: int) -> RoundWork:
            nonlocal now
            if moved := self.replanner.before_round(number, now[0], self.online()):
                self.runner.recorder.replanned(moved.spans())
                now = (moved, with_heads(self.config, moved, now[1]))
            return self._work(number, now[1], now[0])

        def evaluate(
            number: int, merged: dict[str, np.ndarray], edges: list[str]
        ) -> dict[str, float]:
            return _federated(self, number, merged, now[0], edges)

        federated = evaluate if self.config.training.federated_eval > 0 else None
        self.runner.settle = _recalibration(self, lambda: now[0])
        merged = self.runner.run(number, prepare, federated, start=weights)
        self.moves.trained_at(now[0].spans(), self.runner.reported)
        return merged, now[0]

    def _work(self, number: int, weights: dict[str, np.ndarray], placement: Placement) -> RoundWork:
        """One attempt's messages: the strategy's sample of the edges, the online servers."""
        by_node = {a.node: a for a in placement.edges}
        sampled = self.runner.sample(number, list(by_node), weights)
        # sent in name order: a simulation hands out its training slots in that order
        selected = sorted((by_node[node] for node in sampled), key=lambda a: a.device)
        online = set(self.grid.get_node_ids())
        servers = [b for b in placement.servers if b.node in online]
        work = RoundWork([*(a.device for a in selected), *(b.device for b in servers)])
        work.absent = sorted(a.device for a in placement.edges if a.node not in online)
        work.require_server = True
        work.problem = round_problem(placement, servers, len(selected), self.min_edges)
        if work.problem is not None:
            return work
        options = next(iter(sampled.values()), {})
        streams, routes = route(selected, servers)
        spans = placement.spans()  # each device's blocks and head
        mirrors = head_mirrors(self.config.model, self.config.training, {a.end for a in selected})
        work.mirrors = {head: back for names in mirrors.values() for head, back in names.items()}
        arrays_for = device_records(self.runner.recorder, weights, spans, mirrors)
        # the servers' messages go first: a server that starts its round late holds up the
        # edges that already train (the push of 1,000 edges' messages takes seconds)
        for back in servers:
            if not routes[back.device][0]:
                continue  # nothing streams into this piece this round
            task = build_task(self.config, back, self.session, server_route=routes[back.device])
            work.messages[back.device] = build_message(
                self.grid, back.node, arrays_for(back.device), "train", number, task, options
            )
            work.servers[back.device] = span(back)
        for a in selected:
            feeds = [s for s, r in routes.items() if r[2] == streams[a.device]]
            task = build_task(self.config, a, self.session, streams[a.device], servers=feeds)
            told = {**sampled[a.node], **self.moves.options(a.device, spans[a.device])}
            work.messages[a.device] = build_message(
                self.grid, a.node, arrays_for(a.device), "train", number, task, told
            )
        return work


def _federated(
    coordinator: Coordinator,
    number: int,
    weights: dict[str, np.ndarray],
    placement: Placement,
    edges: list[str],
) -> dict[str, float]:
    """The assembled model evaluated by the ``edges`` that trained, on what they hold out."""
    assigned = {a.device: a for a in placement.edges if a.device in edges}

    def message(device: str, configured: Message) -> Message:
        a = assigned[device]
        options = dict(configured.content.config_records[coordinator.strategy.configrecord_key])
        arrays = configured.content.array_records["arrays"]
        recorder = coordinator.runner.recorder
        if recorder.local_keys:  # evaluated with the BatchNorm layers it just trained
            arrays = array_record(recorder.own(device, numpy_arrays(configured), True))
        task = build_task(coordinator.config, a, coordinator.session)
        return build_message(coordinator.grid, a.node, arrays, "evaluate", number, task, options)

    nodes = {device: a.node for device, a in assigned.items()}
    return coordinator.runner.federated(number, weights, nodes, message)


def _recalibration(coordinator: Coordinator, placement: Callable[[], Placement]) -> Settle:
    """The BatchNorm statistics of each aggregate, measured by edges of the round's
    ``placement`` that trained (``norm: recalibrate``; else the aggregate as it is): the
    whole model's where its weights fit the edge's budget beside its training peak, else
    its own blocks'."""
    runner = coordinator.runner
    if coordinator.config.training.norm != "recalibrate":
        return lambda _number, merged, _edges: merged

    def address(number: int, device: str, arrays: ArrayRecord, config: dict[str, int]) -> Message:
        edge = next(a for a in placement().edges if a.device == device)
        task = build_task(coordinator.config, edge, coordinator.session)
        return build_message(coordinator.grid, edge.node, arrays, "evaluate", number, task, config)

    def reach(device: str, model_bytes: int) -> int:
        plan = placement().plan
        edge = next(e for e in plan.edges if e.name == device)
        fits = model_bytes + edge.estimated_peak_bytes <= edge.budget_bytes
        return plan.num_blocks if fits else edge.blocks[1]

    collect = functools.partial(runner.collect, observed=False)
    robust = is_robust(coordinator.strategy)
    return Recalibration(address, collect, runner.deadline / 2, runner.seed, reach, robust)


def _checks(watch: StopWatch, lease: RunLease) -> None:
    """Raise when the run was asked to stop or another coordinator took it over."""
    watch.check()
    lease.check()


def _failed(store: RunStore, run_id: str, why: str) -> None:
    """The run failed (a round gave up): its status, and an event that says why."""
    store.set_run_status(run_id, "failed")
    store.add_event(run_id, Event("run-failed", why))


def _record_stop(store: RunStore, run_id: str, why: str) -> None:
    """Mark the run cancelled; in an outage of the database, at once and not at all (it
    stays ``training``, and resumes the same way): a stop does not wait for the server."""
    store.stop_waiting()
    try:
        mark_cancelled(store, run_id, why)
    except UnreachableError as error:
        log.warning("run %s stays marked training (%s)", run_id, error)


def _out_on_error(guard: SessionGuard) -> Callable[[str, Message], None]:
    """What the grid calls when a device answers a train message with an error: its stream
    has ended, and the try's announcement says so (GPU servers stop waiting for it)."""
    return lambda name, sent: guard.out(name, round_of(sent), attempt_of(sent))


def _say_ended(guard: SessionGuard | None) -> None:
    """Announce that this coordinator's session drives no more rounds (the run finished,
    failed or was cancelled): devices give up whatever they do for it, and a task of it
    that arrives later (a replay) is abandoned, not trained."""
    if guard is None:
        return
    try:
        guard.end()
    except TransportError as error:
        log.warning("could not tell the devices the run stopped: %s", error)


def _central(config: RunConfig, data: Dataset) -> Evaluate:
    """The central evaluation on ``eval_data`` (refused at once, by name, when the model
    cannot take it: not after a round has trained)."""
    if problem := model_data_problem(data, config.model, "eval_data"):
        raise ConfigError(problem)

    def evaluate(weights: Mapping[str, np.ndarray]) -> dict[str, float]:
        return evaluate_weights(config.model, dict(weights), data)

    return evaluate


def _profile_fresh(config: RunConfig, cache: Path | None = None) -> ModelProfile:
    return profile_in_fresh_process(
        config.model, (config.training.local_loss,), config.training.batch_size, cache=cache
    )
