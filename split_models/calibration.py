"""A device's training speed measured at start, in the planner's units.

The planner times a step of a segment as ``3 * batch * forward FLOPs / FLOP/s``
(``coordinator.partitioner``), and the coordinator re-plans when a device's rounds measure a
speed off its declared one by more than ``devices.replan_drift``. A declared speed that is
only a default (an edge's ``--flops`` left out) is usually off by several times, so the first
round's measurement moved the cuts, and the fresh local heads of the new cuts cost accuracy
for a round or two (docs/benchmarks.md, "A device's speed measured at start"). Measuring a few
training steps before announcing puts the first plan near the measured one.
"""

from __future__ import annotations

import time

import torch

from split_models.errors import ConfigError
from split_models.flops import count_flops
from split_models.segment import Segment
from split_models.units import parse_flops
from split_models.zoo import build_model

__all__ = ["flops_option", "measure_flops"]

_SHAPE = (1, 28, 28)  # an MNIST-sized image: the workload of the zoo's default model
_WARM_UP_STEPS = 2


def measure_flops(seconds: float = 0.5, batch: int = 32) -> float:
    """This process's sustained training speed in FLOP/s as the planner counts them, from
    training steps of the zoo's ``cnn`` on random images for about ``seconds`` (after two
    warm-up steps), on the threads torch uses here."""
    generator = torch.Generator().manual_seed(0)
    inputs = torch.rand((batch, *_SHAPE), generator=generator)
    labels = torch.randint(0, 10, (batch,), generator=generator)
    model = build_model("cnn", _SHAPE, 10, seed=0)
    per_sample = count_flops(model.segment(0, model.num_blocks), inputs, batch)
    segment = Segment.from_model(model, 0, model.num_blocks)
    for _ in range(_WARM_UP_STEPS):
        segment.train_step(inputs, labels)
    steps, started = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - started) < seconds or steps < 2:
        segment.train_step(inputs, labels)
        steps += 1
    return 3.0 * batch * per_sample * steps / elapsed


def flops_option(value: str) -> float | None:
    """An agent's ``--flops``: a sustained number of FLOP/s, or None for ``auto`` (measure
    it); a clear error naming ``auto`` for anything else."""
    if str(value).strip().lower() == "auto":
        return None
    try:
        return parse_flops(value, "--flops")
    except ConfigError:
        raise ConfigError(
            f"--flops: expected auto (measured at start, the default) or a sustained number "
            f"of FLOP/s such as 2e9, got {value!r}"
        ) from None
