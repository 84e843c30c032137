"""Where an edge agent gets the built segment it trains a round with.

A deployment runs one agent a device, and the agent keeps the segment it built for its task
(:class:`OwnSegment`, the default). A host running many clients in one process hands its
agents a shared source instead (the simulation's segment pool): built segments are borrowed
for a round, and clients of one cut may train stacked. The agent does not know which: it asks
its source for a :class:`SegmentLease` loaded with the round's weights, trains with the
lease's step and reads the trained weights back from it.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np
import torch

from split_models.segment import Segment, StepResult
from split_models.weights import load_segment_state, segment_state

__all__ = ["OwnSegment", "Pace", "SegmentLease", "SegmentSource"]


class Pace(Protocol):
    """Turns by step that a shared host hands its clients (the simulation's
    :mod:`simulation.pace`): ``begin`` with the round's batch count, then each batch in a
    ``turn``."""

    def begin(self, batches: int) -> None: ...

    def turn(self) -> AbstractContextManager[None]: ...


class SegmentLease:
    """A segment lent for one round: its blocks and head (``segment``: the cut, the
    backprop halves), the step that trains one batch, the weights after the round, and the
    turns its batches take (``pace``; none: the device's own)."""

    def __init__(self, segment: Segment) -> None:
        self.segment = segment
        self.pace: Pace | None = None

    @classmethod
    def fresh(
        cls, segment: Segment, weights: Mapping[str, np.ndarray], proximal_mu: float = 0.0
    ) -> SegmentLease:
        """``segment`` loaded with ``weights`` and a fresh optimizer state (FedProx's
        proximal term anchored at ``weights`` when ``proximal_mu > 0``), lent as is."""
        load_segment_state(segment, weights)
        segment.reset_optimizer(proximal_mu)
        return cls(segment)

    def train_step(self, inputs: torch.Tensor, labels: torch.Tensor) -> StepResult:
        return self.segment.train_step(inputs, labels)

    def state(self) -> dict[str, np.ndarray]:
        """The trained tensors under their global names."""
        return segment_state(self.segment)


class SegmentSource(abc.ABC):
    """Lends built segments to an edge agent, one round at a time."""

    @abc.abstractmethod
    def lease(
        self,
        key: str,
        build: Callable[[], Segment],
        weights: Mapping[str, np.ndarray],
        stackable: bool = False,
        proximal_mu: float = 0.0,
        holder: str = "",
        ordered: bool = False,
    ) -> AbstractContextManager[SegmentLease]:
        """A segment for ``key`` (the task's ``Task.segment_key()``: tasks with one key train
        one kind of built segment; ``build`` makes one), loaded with ``weights`` and
        a fresh optimizer state, held for the round. ``stackable``: the round may train
        together with other clients of ``key`` (local-loss mode), where the source can;
        ``proximal_mu``: FedProx's proximal weight (a round with one trains unstacked);
        ``holder``: the device asking (a shared host may hand out its slots in an order);
        ``ordered``: the GPU servers train the edges one after another (``deterministic``),
        so a shared host must not interleave this client's batches with others'."""

    def slot(self) -> AbstractContextManager[None]:
        """Room for other work of the agent's (evaluation) that a shared host bounds as it
        bounds training; nothing to wait for by default."""
        return contextlib.nullcontext()


class OwnSegment(SegmentSource):
    """The agent's own segment, rebuilt when the task's key changes."""

    def __init__(self) -> None:
        self._own: tuple[str, Segment] | None = None

    @contextlib.contextmanager
    def lease(
        self,
        key: str,
        build: Callable[[], Segment],
        weights: Mapping[str, np.ndarray],
        stackable: bool = False,
        proximal_mu: float = 0.0,
        holder: str = "",
        ordered: bool = False,
    ) -> Iterator[SegmentLease]:
        if self._own is None or self._own[0] != key:
            self._own = (key, build())
        yield SegmentLease.fresh(self._own[1], weights, proximal_mu)
