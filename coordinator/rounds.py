"""The coordinator's round loop on top of a Flower strategy and the run store.

After every round the aggregated weights and the evaluation are committed to the store (through
the strategy's ``evaluate_fn`` hook, which Flower calls with the new global weights). Starting
again on a run with committed rounds continues from the last one: its weights are the initial
weights and only the remaining rounds run, numbered on from where the run stopped.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, MetricRecord
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg

from storage.base import RunStore
from wire.flower import array_record

__all__ = ["Evaluate", "run_rounds"]

Evaluate = Callable[[Mapping[str, np.ndarray]], dict[str, float]]
WEIGHTS_SEGMENT = "global"


def run_rounds(
    store: RunStore,
    run_id: str,
    strategy: FedAvg,
    grid: Grid,
    initial: Mapping[str, np.ndarray],
    rounds: int,
    participants: list[str],
    evaluate: Evaluate,
    round_timeout: float = 3600.0,
) -> int:
    """Train until the run has ``rounds`` committed rounds; return how many ran now."""
    state = store.resume(run_id)
    done = 0 if state is None else state.round.number
    weights = dict(initial) if state is None else dict(state.weights[WEIGHTS_SEGMENT])
    remaining = rounds - done
    if remaining <= 0:
        store.set_run_status(run_id, "finished")
        return 0
    store.set_run_status(run_id, "training")

    clock = [time.monotonic()]  # when the round now running began

    def commit(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        current = {key: value.numpy() for key, value in arrays.items()}
        metrics = evaluate(current)
        if server_round > 0:  # Flower evaluates the initial weights as round 0
            number = done + server_round
            store.open_round(run_id, number, participants)
            store.commit_round(
                run_id,
                number,
                {WEIGHTS_SEGMENT: current},
                metrics={"wall_seconds": time.monotonic() - clock[0]},
                evaluation=metrics,
            )
        clock[0] = time.monotonic()
        return MetricRecord(dict(metrics))

    strategy.start(
        grid=grid,
        initial_arrays=array_record(weights),
        num_rounds=remaining,
        timeout=round_timeout,
        evaluate_fn=commit,
        train_config=ConfigRecord({"round-offset": done}),
    )
    if store.get_run(run_id).current_round == rounds:
        store.set_run_status(run_id, "finished")
    return remaining
