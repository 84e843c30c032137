"""Whole-model rounds through the round engine: every device gets the strategy's own train
message (all the weights and the strategy's config) and the strategy averages what they send
back. The fedavg and centralized baselines run this way, with the same runner, recorder and
store as the split coordinator, so they commit their rounds the same way.

Starting again on a run with committed rounds continues from the last one: its weights are
the starting point and only the remaining rounds run, numbered on from where the run stopped.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping

import numpy as np
from flwr.app import ArrayRecord, Message
from flwr.serverapp.strategy import FedAvg

from coordinator.aggregation import is_robust
from coordinator.assignments import build_message
from coordinator.errors import CoordinatorError
from coordinator.recorder import WEIGHTS_SEGMENT, Evaluate, RoundObserver, RoundRecorder
from coordinator.runner import RoundRunner, RoundWork
from coordinator.statistics import Recalibration
from coordinator.stopping import mark_cancelled
from storage.base import RunStore
from wire.flower import TransportGrid, array_record

__all__ = ["run_federated"]


def run_federated(
    store: RunStore,
    run_id: str,
    strategy: FedAvg,
    grid: TransportGrid,
    initial: Mapping[str, np.ndarray],
    rounds: int,
    devices: Mapping[str, int],
    evaluate: Evaluate | None = None,
    deadline: float = 3600.0,
    seed: int = 0,
    local_keys: frozenset[str] = frozenset(),
    recalibrate: bool = False,
    observer: RoundObserver | None = None,
) -> int:
    """Train until the run has ``rounds`` committed rounds over ``devices`` (name -> node id),
    each waiting up to ``deadline`` s; return how many ran now. ``local_keys``: tensors each
    device keeps (FedBN); ``recalibrate``: devices measure each aggregate's BatchNorm
    statistics; ``observer`` (a progress display) hears about every round. Interrupted
    (Ctrl-C, SIGTERM), the run is marked cancelled, not left training."""
    state = store.resume(run_id)
    done = 0 if state is None else state.round.number
    weights = dict(initial) if state is None else dict(state.weights[WEIGHTS_SEGMENT])
    if done >= rounds:
        return _finished(store, run_id, 0)
    store.set_run_status(run_id, "training")
    recorder = RoundRecorder(store, run_id, strategy, observer or RoundObserver(), evaluate, rounds)
    recorder.keep_local(local_keys, None if state is None else state.weights)
    recorder.take_up(state, weights)
    runner = _runner(grid, strategy, recorder, (seed, deadline), devices if recalibrate else None)
    names = {node: name for name, node in devices.items()}

    def prepare(number: int) -> RoundWork:
        sampled = runner.sample(number, sorted(names), weights)
        work = RoundWork([names[node] for node in sampled])
        if not sampled:
            work.problem = f"none of {sorted(devices)} is online"
        shared = array_record(weights)
        for node, options in sampled.items():
            arrays = _arrays(recorder, names[node], weights, shared)
            message = build_message(grid, node, arrays, "train", number, options=options)
            work.messages[names[node]] = message
        return work

    with _status_on_stop(store, run_id):
        for number in range(done + 1, rounds + 1):
            weights = runner.run(number, prepare)
    return _finished(store, run_id, rounds - done)


@contextlib.contextmanager
def _status_on_stop(store: RunStore, run_id: str) -> Iterator[None]:
    """The run marked failed when a round fails, cancelled when it is interrupted."""
    try:
        yield
    except CoordinatorError:
        store.set_run_status(run_id, "failed")
        raise
    except KeyboardInterrupt as stop:
        mark_cancelled(store, run_id, f"interrupted ({stop or 'SIGINT'})")
        raise


def _finished(store: RunStore, run_id: str, ran: int) -> int:
    """Mark the run finished; ``ran``: the rounds run now."""
    store.set_run_status(run_id, "finished")
    return ran


def _runner(
    grid: TransportGrid,
    strategy: FedAvg,
    recorder: RoundRecorder,
    timing: tuple[int, float],
    recalibrate: Mapping[str, int] | None,
) -> RoundRunner:
    """The round engine (``timing``: seed and deadline); with ``recalibrate`` (name -> node),
    those devices measure each aggregate's BatchNorm statistics (they train the whole model,
    so they measure all of it)."""
    seed, deadline = timing
    runner = RoundRunner(grid, strategy, recorder, seed, deadline)
    if recalibrate is None:
        return runner

    def address(number: int, device: str, arrays: ArrayRecord, config: dict[str, int]) -> Message:
        return build_message(grid, recalibrate[device], arrays, "evaluate", number, options=config)

    collect = functools.partial(runner.collect, observed=False)
    runner.settle = Recalibration(address, collect, deadline / 2, seed, None, is_robust(strategy))
    return runner


def _arrays(
    recorder: RoundRecorder, device: str, weights: Mapping[str, np.ndarray], shared: ArrayRecord
) -> ArrayRecord:
    """The weights ``device`` trains from: ``shared``, or with its own local tensors."""
    return array_record(recorder.own(device, weights)) if recorder.local.get(device) else shared
