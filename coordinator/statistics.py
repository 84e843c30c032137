"""BatchNorm statistics re-estimated after each aggregation (``norm: recalibrate``).

Averaging replicas trained apart averages their BatchNorm running means and variances too, but
the averaged model's features are not the average of theirs: measured on the data, its
statistics differ, and evaluated with the averaged ones a resnet8 of 16 FedAvg clients stayed
near chance for three rounds while the same weights with statistics measured on 160 samples
scored 0.77 (docs/benchmarks.md, "BatchNorm after aggregation"). So after the strategy
aggregates, up to :data:`DEVICES` of the edges that trained forward :data:`SAMPLES` of their
own samples through the aggregate (an ``evaluate`` message whose config carries
:data:`~split_models.evaluation.STATISTICS`), without autograd, and send each BatchNorm
layer's mean and variance; the coordinator pools them by sample count into the model it
evaluates and commits. An edge measures the whole model where its weights fit its memory
beside the segment it trains, else its own blocks; a layer no edge measured (a GPU server's,
then) keeps its average.

A reply is checked like any other: the layers asked for, their shapes, finite values, no
negative variance, a count within what was asked; one that fails is left out by name. With no
usable reply the averaged statistics stay, and the log says so. A device may still lie within
those checks; with a robust strategy (fedmedian, krum...) the statistics pool by medians.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterable, Mapping

import numpy as np
from flwr.app import ArrayRecord, Message

from split_models.evaluation import (
    STATISTIC_BLOCKS,
    STATISTIC_SUFFIXES,
    STATISTICS,
    statistic_keys,
    statistic_layers,
)
from wire.flower import array_record, numpy_arrays
from wire.logs import printable

__all__ = [
    "DEVICES",
    "MEAN_SPREAD",
    "SAMPLES",
    "VAR_RATIO",
    "WAIT",
    "Address",
    "Reach",
    "Recalibration",
    "blocks_of",
    "outliers",
    "pool_statistics",
    "statistics_of",
]

log = logging.getLogger(__name__)
DEVICES = 8  # edges asked per round (a sample when more trained)
SAMPLES = 256  # samples each one forwards (0.77 from 160 in the measurement above)
WAIT = 60.0  # seconds the round waits for them at most (a frozen edge holds it that long)
MEAN_SPREAD, VAR_RATIO = 10.0, 100.0  # how far one edge may stray from the others' medians
_MEAN, _VAR = STATISTIC_SUFFIXES
_EPS = 1e-5  # BatchNorm's own
_LARGEST = 1e8  # a mean above this is an activation the GPU servers refuse (max_activation)
Collect = Callable[[dict[str, Message], float], dict[str, Message]]
Address = Callable[[int, str, ArrayRecord, dict[str, int]], Message]
Reach = Callable[[str, int], int]


def statistics_of(
    reply: Message, expected: Mapping[str, np.ndarray], most: int
) -> tuple[int, dict[str, np.ndarray]] | str:
    """The sample count and statistics a reply carries, or what is wrong with it."""
    if reply.has_error():
        return f"failed: {printable(reply.error.reason)}"
    count = _count(reply)
    if count is None or not 1 < count <= most:
        return f"a sample count outside (1, {most}]"
    try:
        arrays = numpy_arrays(reply)
    except Exception as error:  # a device may send anything: undecodable is no statistics
        return printable(f"no statistics ({type(error).__name__}: {error})")
    if set(arrays) != set(expected):
        unknown = sorted(set(arrays) ^ set(expected))[:3]
        return f"other layers than asked ({', '.join(unknown)})"
    for key, array in arrays.items():
        if array.shape != expected[key].shape:
            return f"{key} has shape {list(array.shape)}, not {list(expected[key].shape)}"
        if array.dtype.kind != "f":
            return f"{key} holds {array.dtype} values, not floating point"
        if not np.isfinite(array).all():
            return f"{key} holds NaN or infinity"
        if key.endswith(_VAR) and (array < 0).any():
            return f"{key} holds a negative variance"
        bound = _LARGEST**2 if key.endswith(_VAR) else _LARGEST
        if (np.abs(array) > bound).any():
            return f"{key} holds values above {bound:.0e} (activations that large are refused)"
    return count, arrays


def outliers(measured: Mapping[str, tuple[int, dict[str, np.ndarray]]]) -> dict[str, str]:
    """Devices whose statistics for a layer that three devices or more measured stray far
    from those devices' medians (a mean more than :data:`MEAN_SPREAD` standard deviations
    off, or a variance off by more than :data:`VAR_RATIO` times), with why: an honest
    device's features differ from the others' in degree, not by orders of magnitude."""
    found: dict[str, str] = {}
    for layer in _layers(s for _, s in measured.values()):
        held = {d: s for d, (_, s) in measured.items() if layer + _MEAN in s}
        if len(held) < 3:
            continue
        mean = np.median(np.stack([s[layer + _MEAN] for s in held.values()]), axis=0)
        var = np.median(np.stack([s[layer + _VAR] for s in held.values()]), axis=0) + _EPS
        for device, s in held.items():
            ratio = (s[layer + _VAR] + _EPS) / var
            if (np.abs(s[layer + _MEAN] - mean) > MEAN_SPREAD * np.sqrt(var)).any():
                found.setdefault(device, f"{layer}'s means stray from the other edges'")
            elif ((ratio > VAR_RATIO) | (ratio < 1 / VAR_RATIO)).any():
                found.setdefault(device, f"{layer}'s variances stray from the other edges'")
    return found


def _count(reply: Message) -> int | None:
    metrics = reply.content.metric_records.get("metrics")
    value = None if metrics is None else metrics.get("num-examples")
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def pool_statistics(
    measured: list[tuple[int, dict[str, np.ndarray]]], robust: bool = False
) -> dict[str, np.ndarray]:
    """Each layer's mean and variance over the union of the samples of the devices that
    measured it, by count: the mean of their means, and the mean of their second moments
    less the square of that mean. ``robust`` (the run's strategy is a robust rule): a layer
    three devices or more measured takes the coordinate-wise medians instead, so one device
    that lies cannot move it far."""
    pooled: dict[str, np.ndarray] = {}
    for layer in _layers(s for _, s in measured):
        held = [
            (c, s[layer + _MEAN].astype(np.float64), s[layer + _VAR].astype(np.float64))
            for c, s in measured
            if layer + _MEAN in s
        ]
        counts = np.array([c for c, _, _ in held], np.float64)[:, None]
        means = np.stack([m.reshape(-1) for _, m, _ in held])
        seconds = np.stack([(v + m**2).reshape(-1) for _, m, v in held])
        if robust and len(held) >= 3:
            mean, second = np.median(means, axis=0), np.median(seconds, axis=0)
        else:
            mean = (counts * means).sum(0) / counts.sum()
            second = (counts * seconds).sum(0) / counts.sum()
        shape = held[0][1].shape
        pooled[layer + _MEAN] = mean.reshape(shape).astype(np.float32)
        pooled[layer + _VAR] = np.maximum(second - mean**2, 0.0).reshape(shape).astype(np.float32)
    return pooled


def _layers(statistics: Iterable[Mapping[str, np.ndarray]]) -> list[str]:
    """The BatchNorm layers (names without ``.running_mean``) in any of ``statistics``."""
    return sorted({layer for s in statistics for layer in statistic_layers(s)})


def blocks_of(weights: Mapping[str, np.ndarray], end: int) -> dict[str, np.ndarray]:
    """The tensors of blocks ``[0, end)`` among ``weights`` (no local heads)."""
    return {k: v for k, v in weights.items() if (i := _block(k)) is not None and i < end}


def _block(key: str) -> int | None:
    """The block a tensor name ``block<i>.<...>`` belongs to (None: a head's or another)."""
    index = key.partition(".")[0].removeprefix("block")
    return int(index) if key.startswith("block") and index.isdigit() else None


class Recalibration:
    """Re-estimates the statistics of an aggregate: ``address`` makes a device's message
    (round, device, the tensors it measures with, config entries), ``collect`` sends and
    gathers them until ``deadline`` seconds (at most :data:`WAIT`);
    ``reach(device, model_bytes)``: the blocks ``[0, end)`` it measures (the whole model
    where its ``model_bytes`` fit beside what the device trains, else its own blocks; None:
    every device trains, so measures, the whole model)."""

    def __init__(
        self,
        address: Address,
        collect: Collect,
        deadline: float,
        seed: int,
        reach: Reach | None,
        robust: bool = False,
    ) -> None:
        self.address, self.collect, self.seed = address, collect, seed
        self.deadline = min(deadline, WAIT)
        self.reach, self.robust = reach, robust

    def __call__(
        self, number: int, merged: dict[str, np.ndarray], trained: list[str]
    ) -> dict[str, np.ndarray]:
        """``merged`` with the statistics that ``trained`` edges measured (unchanged when
        the model has no BatchNorm, or none answered usably)."""
        if not statistic_keys(merged) or not trained:
            return merged
        asked = sorted(trained)
        if len(asked) > DEVICES:
            asked = sorted(random.Random(self.seed * 100_003 + number).sample(asked, DEVICES))
        messages, expected = {}, {}
        blocks = 1 + max(i for k in merged if (i := _block(k)) is not None)
        model_bytes = sum(v.nbytes for v in blocks_of(merged, blocks).values())
        for device in asked:
            end = blocks if self.reach is None else min(self.reach(device, model_bytes), blocks)
            tensors = blocks_of(merged, end)
            if keys := statistic_keys(tensors):  # its blocks hold BatchNorm layers
                expected[device] = {k: merged[k] for k in keys}
                config = {STATISTICS: SAMPLES, STATISTIC_BLOCKS: end}
                messages[device] = self.address(number, device, array_record(tensors), config)
        replies = self.collect(messages, self.deadline) if messages else {}
        measured = self._usable(number, replies, expected)
        if not measured:
            log.warning(
                "round %d: no edge measured the BatchNorm statistics (%d asked); the averaged "
                "ones stay",
                number,
                len(messages),
            )
            return merged
        log.info(
            "round %d: BatchNorm statistics measured by %s (%d samples)",
            number,
            ", ".join(measured),
            sum(count for count, _ in measured.values()),
        )
        return merged | pool_statistics(list(measured.values()), self.robust)

    def _usable(
        self,
        number: int,
        replies: dict[str, Message],
        expected: dict[str, dict[str, np.ndarray]],
    ) -> dict[str, tuple[int, dict[str, np.ndarray]]]:
        """The replies that pass the checks and do not stray from the others; each one left
        out, and each edge that did not answer, is named in a warning."""
        measured: dict[str, tuple[int, dict[str, np.ndarray]]] = {}
        problems = {d: "no answer in time" for d in expected if d not in replies}
        for device, reply in sorted(replies.items()):
            result = statistics_of(reply, expected[device], SAMPLES)
            if isinstance(result, str):
                problems[device] = result
            else:
                measured[device] = result
        problems |= outliers(measured)
        for device, why in sorted(problems.items()):
            measured.pop(device, None)
            log.warning("round %d: %s's BatchNorm statistics left out: %s", number, device, why)
        return measured
