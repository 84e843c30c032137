"""A split plan as data: which blocks each device trains, what memory and bytes that costs.

Computing a plan (``coordinator.partitioner``) and applying it (the roles) are separate steps.
A plan prints as a readable table and round-trips through a stable JSON form.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from split_models.errors import ConfigError
from split_models.units import format_bytes

__all__ = ["EdgeAssignment", "Plan", "ServerAssignment"]

PLAN_FORMAT = 1


@dataclass(frozen=True)
class EdgeAssignment:
    """An edge device trains blocks ``[0, blocks[1])`` with a local-loss head."""

    name: str
    blocks: tuple[int, int]
    estimated_peak_bytes: int
    budget_bytes: int
    cut_bytes_per_sample: int  # activations at the plan's compression, plus the int64 label
    flops_per_sample: int  # forward FLOPs of the blocks and the head
    step_seconds: float  # estimated time of one batch: max(compute, upload), they overlap
    weight_bytes: int = 0  # the segment's and its head's weights: down and up once a round


@dataclass(frozen=True)
class ServerAssignment:
    """A GPU server trains blocks ``[start, end)`` on the activations streamed to it."""

    name: str
    blocks: tuple[int, int]
    estimated_peak_bytes: int
    budget_bytes: int


def describe_cuts(cuts: Mapping[str, int], listed: int = 12) -> str:
    """Each edge's cut, ``{'pi-01': 2, 'pi-02': 5}``; for more than ``listed`` edges, how many
    edges hold each cut, ``{2: '600 edges', 5: '400 edges'}``."""
    if len(cuts) <= listed:
        return str(dict(cuts))
    counts = Counter(cuts.values())
    return str({cut: f"{counts[cut]} edges" for cut in sorted(counts)})


@dataclass(frozen=True)
class Plan:
    """The whole assignment of a model's blocks to devices for one configuration."""

    model: str
    num_blocks: int
    batch_size: int
    optimizer: str
    local_loss: str
    compression: str
    edges: tuple[EdgeAssignment, ...]
    servers: tuple[ServerAssignment, ...]
    estimated_step_seconds: float
    bottleneck: str
    input_shape: tuple[int, ...] = ()
    num_classes: int = 0
    format: int = field(default=PLAN_FORMAT)
    mode: str = "local-loss"  # or backprop (splitfed): its edges train no local head

    def edge(self, name: str) -> EdgeAssignment:
        for assignment in self.edges:
            if assignment.name == name:
                return assignment
        raise KeyError(f"no edge named {name!r} in the plan")

    def edge_cuts(self) -> dict[str, int]:
        """Each edge's cut: ``{'pi-01': 2, 'pi-02': 5}``."""
        return {e.name: e.blocks[1] for e in self.edges}

    def cuts(self, listed: int = 12) -> str:
        """The edges' cuts as :func:`describe_cuts` writes them."""
        return describe_cuts(self.edge_cuts(), listed)

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for group in ("edges", "servers"):
            for entry in data[group]:
                entry["blocks"] = list(entry["blocks"])
        data["input_shape"] = list(self.input_shape)
        return data

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        if data.get("format") != PLAN_FORMAT:
            raise ConfigError(f"plan: format {data.get('format')!r} is not {PLAN_FORMAT}")
        try:
            edges = tuple(
                EdgeAssignment(**{**e, "blocks": tuple(e["blocks"])}) for e in data["edges"]
            )
            servers = tuple(
                ServerAssignment(**{**s, "blocks": tuple(s["blocks"])}) for s in data["servers"]
            )
            fields = {k: v for k, v in data.items() if k not in ("edges", "servers")}
            fields["input_shape"] = tuple(fields.get("input_shape", ()))
            return cls(edges=edges, servers=servers, **fields)
        except (KeyError, TypeError) as error:
            raise ConfigError(f"plan: malformed plan data: {error}") from error

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def _loss(self) -> str:
        """How the edges learn: a local loss, or the back's gradient (splitfed)."""
        if self.mode == "backprop":
            return "splitfed (backprop: the edges train on the back's gradient, no local head)"
        return f"local loss {self.local_loss}"

    def __str__(self) -> str:
        lines = [
            f"plan for {self.model} ({self.num_blocks} blocks), batch {self.batch_size}, "
            f"{self.optimizer}, {self._loss()}, activations {self.compression}",
            f"{'device':<16} {'kind':<5} {'blocks':<9} {'estimate':>11} {'budget':>11} "
            f"{'use':>5} {'cut/sample':>11} {'step s':>9}",
        ]
        for e in self.edges:
            lines.append(
                f"{e.name:<16} {'edge':<5} {_span(e.blocks):<9} "
                f"{format_bytes(e.estimated_peak_bytes):>11} {format_bytes(e.budget_bytes):>11} "
                f"{e.estimated_peak_bytes / e.budget_bytes:>5.0%} "
                f"{format_bytes(e.cut_bytes_per_sample):>11} {e.step_seconds:>9.4f}"
            )
        for s in self.servers:
            lines.append(
                f"{s.name:<16} {'gpu':<5} {_span(s.blocks):<9} "
                f"{format_bytes(s.estimated_peak_bytes):>11} {format_bytes(s.budget_bytes):>11} "
                f"{s.estimated_peak_bytes / s.budget_bytes:>5.0%}"
            )
        lines.append(
            f"estimated step time {self.estimated_step_seconds:.4f} s (bound by {self.bottleneck})"
        )
        return "\n".join(lines)


def _span(blocks: tuple[int, int]) -> str:
    return f"[{blocks[0]}, {blocks[1]})"
