"""Bounds on what an edge's reply may claim (issue 16: a device account may lie).

**Examples** (its weight in the mean). An edge's ``num-examples`` is capped before aggregation
by one of two rules, named in the ``examples-capped`` event that says when one bites:

- ``server-count`` (split modes): every example an edge trains on streams its activations to a
  GPU server, which reports per sender the examples it trained this round (its reply's
  :data:`~wire.flower.TRAINED_RECORD`, over every local epoch, as the edge counts them; a
  batch it refused counts not). An edge is weighted by at most the sum over the servers.
  GPU servers are trusted accounts; their counts are still checked for shape and type.
- ``peer-median`` (no server counts: the whole-model baselines): an edge is weighted by at most
  ``factor`` times the median of the other edges' claims. It needs one peer at least (with a
  single edge its weight is its own); it bounds a liar's share of the mean to about
  ``factor / (factor + n - 1)`` among ``n`` edges, and trims an honest edge holding more than
  ``factor`` times its peers' median. A federated evaluation's claimed test examples (nobody
  counts them) are capped by this rule too.

**Tensors.** A reply may hold only tensors its train message gave the device, each in the
shape it was given (:func:`foreign_tensors`): an edge writing a block it was not given (the GPU
servers' back, say) or a tensor of another shape is left out of the round, named.

**Updates** (``norm bound``, Sun et al. 2019, "Can you really backdoor federated learning?").
Among the replicas holding the same tensors, an update ``w_i - w_round_start`` whose norm is
above ``factor`` times the group's median norm is scaled down onto that bound. A group of
fewer than :data:`MIN_JUDGED` replicas cannot judge (no majority defines "normal"), nor can
one whose median update is zero. Every group, judged or not, refuses an update more than
:data:`IMPLAUSIBLE` times the norm its tensors start the round with (at least 1): no training
step moves a block that far, and a device that alone holds its blocks (a cut no other edge
shares, which a device may get by announcing a large memory) wrote ``1e20`` into them
unjudged, failing every try of the round. Its replica is kept at the round's start instead
(:func:`plausible_limit`). A subtler lie in blocks no other edge holds is not caught: only
replicas can say what is normal (``cuts: uniform`` gives every edge the same blocks).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = [
    "EXAMPLES_BOUND",
    "IMPLAUSIBLE",
    "MIN_JUDGED",
    "NORM_BOUND",
    "STATISTICS",
    "Cap",
    "bound_replica",
    "cap_examples",
    "clip_update",
    "foreign_tensors",
    "norm_limit",
    "plausible_limit",
    "server_counts",
    "update_norm",
]

EXAMPLES_BOUND = 10.0  # peer-median: at most this many times the other edges' median claim
NORM_BOUND = 10.0  # norm bound: at most this many times the group's median update norm
MIN_JUDGED = 3  # replicas a group needs before its median says what a normal update is
IMPLAUSIBLE = 10.0  # an update above this many times its tensors' norm is no training step
# BatchNorm's statistics are measured, not learned: a running variance may grow 1000-fold in
# a round on unscaled inputs, so they are no part of an update's plausibility
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class Cap:
    """An edge whose claimed examples were above what ``rule`` allows."""

    device: str
    claimed: float
    allowed: float
    rule: str

    def __str__(self) -> str:
        why = (
            "the GPU servers trained that many of its examples this round"
            if self.rule == "server-count"
            else "the bound from its peers' median claim"
        )
        return (
            f"{self.device} claimed {self.claimed:.0f} examples; weighted by "
            f"{self.allowed:.0f} ({self.rule}: {why})"
        )


def server_counts(records: Sequence[object]) -> dict[str, int] | str:
    """The examples the GPU servers trained per sender, summed over their ``records`` (each a
    mapping of sender name to count), or why they cannot be used."""
    total: dict[str, int] = {}
    for record in records:
        if not isinstance(record, Mapping):
            return f"a GPU server sent {type(record).__name__} counts, expected name -> count"
        for sender, count in record.items():
            if not isinstance(sender, str) or isinstance(count, bool) or not isinstance(count, int):
                return f"a GPU server counted {count!r} examples of {sender!r}, expected a count"
            if count < 0:
                return f"a GPU server counted {count} examples of {sender!r}, expected >= 0"
            total[sender] = total.get(sender, 0) + count
    return total


def cap_examples(
    claims: Mapping[str, float], trained: Mapping[str, int] | None, factor: float = EXAMPLES_BOUND
) -> list[Cap]:
    """The edges (``claims``: name -> claimed examples) whose claim is above what they may
    claim: what the GPU servers ``trained`` of them (``server-count``) or, without those
    counts, ``factor`` times the median of the other edges' claims (``peer-median``; 0:
    off)."""
    if trained is not None:
        return [
            Cap(device, claim, float(trained.get(device, 0)), "server-count")
            for device, claim in sorted(claims.items())
            if claim > trained.get(device, 0)
        ]
    if factor <= 0 or len(claims) < 2:
        return []
    caps = []
    for device, claim in sorted(claims.items()):
        allowed = factor * float(np.median([c for d, c in claims.items() if d != device]))
        if claim > allowed:
            caps.append(Cap(device, claim, allowed, "peer-median"))
    return caps


def foreign_tensors(given: Mapping[str, Any], sent: Mapping[str, Any]) -> str | None:
    """Why the tensors a device ``sent`` back do not fit those it was ``given`` (name to
    anything with a ``shape`` and a ``dtype``: Flower's ``Array``, numpy's), or None. Another
    dtype is refused too: an integer tensor would pass the norm bound and the NaN check."""
    foreign = [name for name in sent if name not in given]
    if foreign:
        return f"sent tensors it was not given ({', '.join(sorted(foreign)[:3])})"
    for name, array in sent.items():
        if tuple(array.shape) != tuple(given[name].shape):
            return (
                f"sent {name} of shape {list(array.shape)}, it was given {list(given[name].shape)}"
            )
        if np.dtype(array.dtype) != np.dtype(given[name].dtype):
            return f"sent {name} as {np.dtype(array.dtype)}, it was given {given[name].dtype}"
    return None


def update_norm(replica: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray]) -> float:
    """The L2 norm of ``replica - start`` over ``replica``'s floating-point tensors."""
    squares = 0.0
    for key, array in replica.items():
        if np.issubdtype(array.dtype, np.floating):
            delta = array.astype(np.float64) - start[key].astype(np.float64)
            squares += float(np.sum(delta * delta))
    return math.sqrt(squares)


def norm_limit(norms: Sequence[float], factor: float = NORM_BOUND) -> float | None:
    """The largest update norm a group with these ``norms`` accepts: ``factor`` times their
    median; None when the group cannot judge (fewer than :data:`MIN_JUDGED` replicas, a zero
    median) or the bound is off (``factor`` 0)."""
    if factor <= 0 or len(norms) < MIN_JUDGED:
        return None
    median = float(np.median(norms))
    return factor * median if median > 0 and math.isfinite(median) else None


def plausible_limit(keys: Sequence[str], start: Mapping[str, np.ndarray]) -> float:
    """The largest update norm any replica of the tensors ``keys`` may have, in a group of
    any size: :data:`IMPLAUSIBLE` times their norm at the round's start, at least 1 (a block
    of zeros, such as a fresh bias, still learns); BatchNorm's statistics count in neither."""
    squares = sum(
        float(np.sum(start[k].astype(np.float64) ** 2))
        for k in _learned(keys)
        if np.issubdtype(start[k].dtype, np.floating)
    )
    return IMPLAUSIBLE * max(math.sqrt(squares), 1.0)


def _learned(keys: Iterable[str]) -> list[str]:
    return [k for k in keys if k.rsplit(".", 1)[-1] not in STATISTICS]


def clip_update(
    replica: Mapping[str, np.ndarray], start: Mapping[str, np.ndarray], scale: float
) -> dict[str, np.ndarray]:
    """``replica`` with its update from ``start`` scaled by ``scale`` (floating-point tensors;
    others, such as BatchNorm's batch count, as they are)."""
    if not 0 <= scale <= 1:
        raise ValueError(f"an update is clipped by a scale in [0, 1], got {scale}")
    return {
        key: (start[key] + scale * (array.astype(np.float64) - start[key])).astype(array.dtype)
        if np.issubdtype(array.dtype, np.floating)
        else array
        for key, array in replica.items()
    }


def bound_replica(
    tensors: Mapping[str, np.ndarray],
    start: Mapping[str, np.ndarray],
    norm: float,
    limits: tuple[int, float | None, float],
    named: str,
    factor: float,
) -> tuple[dict[str, np.ndarray] | None, str]:
    """``tensors``, one replica (``named``: "pi-03's update of block2.*") of a group of
    ``size`` whose update has ``norm``, within the group's ``limits`` (size, the norm bound's
    limit or None, :func:`plausible_limit`): clipped, and why; ``(None, "")`` when within."""
    size, judged, plausible = limits
    learned = _learned(tensors)  # the update's norm again only where statistics are left out
    step = (
        norm
        if len(learned) == len(tensors)
        else update_norm({k: tensors[k] for k in learned}, start)
    )
    if not step <= plausible:
        return clip_update(tensors, start, 0.0), (
            f"{named} has norm {step:.4g}, over {plausible / IMPLAUSIBLE:.4g} x "
            f"{IMPLAUSIBLE:g} (the norm of the weights it was given, at least 1): no training "
            "step moves them that far; left out (its replica kept at the round's start)"
        )
    if judged is None or norm <= judged:
        return None, ""
    return clip_update(tensors, start, judged / norm), (
        f"{named} has norm {norm:.4g}, above {factor:g} x the median {judged / factor:.4g} of "
        f"the {size} replicas holding them; clipped to {judged:.4g} (norm bound)"
    )
