"""Rounds that must not commit: non-finite weights or loss, or a loss that jumped.

Split training at a learning rate a little too high for it can blow up within a round: one
device's weights go to infinity or NaN, or the back's loss leaps while every reply still
arrives on time. Committing such a round would make every later round start from it. The
runner asks :func:`non_finite_tensors` of every reply (such a device counts as failed, its
weights are not aggregated) and :func:`divergence` of the aggregate before it commits; a
round that diverged is retried from the last committed weights, and the run's events say why.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence

import numpy as np

from storage.records import DeviceResult, RoundRecord

__all__ = ["JUMP_FACTOR", "JUMP_MARGIN", "divergence", "non_finite_tensors"]

# A loss "jumped" when it is above JUMP_FACTOR times the last committed round's and at least
# JUMP_MARGIN nats above it (small losses fluctuate by large factors).
JUMP_FACTOR = 3.0
JUMP_MARGIN = 1.0


def non_finite_tensors(arrays: Mapping[str, np.ndarray]) -> list[str]:
    """The names of the floating-point (or complex) tensors holding NaN or infinity."""
    return sorted(
        name
        for name, array in arrays.items()
        if np.issubdtype(array.dtype, np.inexact) and not np.isfinite(array).all()
    )


def _jumped(now: float | None, before: float | None) -> bool:
    if now is None or before is None or not math.isfinite(before):
        return False
    return now > JUMP_FACTOR * before and now > before + JUMP_MARGIN


def divergence(
    weights: Mapping[str, np.ndarray],
    evaluation: Mapping[str, float],
    results: Sequence[DeviceResult],
    previous: RoundRecord | None,
    edges: Collection[str] = (),
) -> str | None:
    """Why the aggregate of a round must not be committed, or None when it may: a non-finite
    tensor, a non-finite evaluation loss, or a loss that jumped against ``previous`` (the last
    committed round): the evaluation's loss when both rounds have one, else the devices'
    training losses against their own in ``previous``. A loss is what its device says: a GPU
    server's jump refuses the round; the ``edges``' only when most of those that can be
    compared jumped (one edge reporting a leap must not fail every try of the run)."""
    bad = non_finite_tensors(weights)
    if bad:
        return f"the aggregated weights hold NaN or infinity ({', '.join(bad[:3])})"
    loss = evaluation.get("loss")
    if loss is not None and not math.isfinite(loss):
        return f"the evaluation loss is {loss}"
    if previous is None:
        return None
    before = previous.evaluation.get("loss")
    if loss is not None and before is not None:
        if _jumped(loss, before):
            return f"the evaluation loss jumped from {before:.3f} to {loss:.3f}"
        return None
    return _device_jumps(results, previous, set(edges))


def _device_jumps(
    results: Sequence[DeviceResult], previous: RoundRecord, edges: set[str]
) -> str | None:
    earlier = {r.device: r.loss for r in previous.results if not r.failure}
    compared = [r for r in results if r.loss is not None and earlier.get(r.device) is not None]
    jumped = [r for r in compared if _jumped(r.loss, earlier[r.device])]
    said = [f"{r.device}'s from {earlier[r.device]:.3f} to {r.loss:.3f}" for r in jumped]
    for result in jumped:
        if result.device not in edges:  # a GPU server: the back's loss, on the operator's side
            before = earlier[result.device]
            return f"{result.device}'s training loss jumped from {before:.3f} to {result.loss:.3f}"
    among = sum(1 for r in compared if r.device in edges)
    if jumped and 2 * len(jumped) > among:
        return f"{len(jumped)} of {among} edges' training losses jumped ({'; '.join(said[:3])})"
    return None
