"""An edge's first round at a new cut bounds the step of the blocks it trains, not its head.

A re-plan (measured speeds, an edge back with less memory) moves an edge's cut. Where it moves
deeper, the blocks it takes over were trained by the GPU servers, whose steps are bounded
(``training.server_max_step``), and its local head at the new cut is fresh. The edge's steps
are not bounded by default: at SGD momentum lr 0.05 the fresh head's first gradients moved
the blocks by 18-46 % in one round and accuracy fell 11-22 points that round (one run of
four failed it three times). Bounding the whole first round (head too) removed that dip but
kept the head untrained, and the next, unbounded round wrecked the blocks instead. So an
edge's first round at a cut other than the one it last trained at bounds its blocks' steps as
the servers' are (``max-step`` in its train message, ``Segment.step_bound``) and lets the head
learn freely; its later rounds are bounded by nothing but the optimizer
(docs/benchmarks.md, "A re-plan's first round at a new cut").
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from split_models.config import TrainingConfig

__all__ = ["MovedEdges"]

Span = tuple[int, int, "int | None"]


class MovedEdges:
    """The cut each edge last trained at, and the bound on its steps at another one."""

    def __init__(self, training: TrainingConfig) -> None:
        self.bound = training.server_optimizer().max_step  # the servers' bound on a step
        self.trained: dict[str, Span] = {}  # edge -> the blocks and head of its last round

    def options(self, device: str, span: Span) -> dict[str, float]:
        """What ``device``'s train message adds for a round at ``span``: the bound when it
        last trained at another cut (nothing for its first round of this coordinator's: a
        restarted one does not know where it trained)."""
        last = self.trained.get(device)
        if self.bound is None or last is None or last == span:
            return {}
        return {"max-step": self.bound}

    def trained_at(self, spans: Mapping[str, Span], devices: Iterable[str]) -> None:
        """``devices`` trained a round at their ``spans``."""
        self.trained.update({d: spans[d] for d in devices if d in spans})
