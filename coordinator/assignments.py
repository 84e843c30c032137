"""Who trains which blocks, the stream layout of a round, and the messages devices receive.

Pure functions over plain data: an :class:`Assignment` per device, :func:`route` (the
streams of one round), :func:`keys_for` (the tensors a device needs), :func:`build_task` and
:func:`build_message` (a device's :class:`~wire.roles.Task` and its Flower message).
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from coordinator.config import RunConfig
from split_models.config import config_to_dict
from wire.roles import Task, node_id_for

__all__ = ["Assignment", "Route", "build_message", "build_task", "keys_for", "route", "span"]

Route = tuple[list[str], list[str], str, str | None]
"""A server's senders, the peers sharing its piece, its stream and the next piece's stream."""


@dataclass(frozen=True)
class Assignment:
    """``device`` (role ``edge`` or ``gpu``) trains blocks ``[start, end)``."""

    device: str
    start: int
    end: int
    estimate: int
    role: str

    @property
    def node(self) -> int:
        return node_id_for(self.device)


def span(assignment: Assignment) -> tuple[int, int]:
    """The block range ``(start, end)`` of ``assignment``."""
    return assignment.start, assignment.end


def keys_for(
    weights: Mapping[str, np.ndarray], start: int, end: int, head: int | None
) -> dict[str, np.ndarray]:
    """The tensors of blocks ``[start, end)`` and, if ``head`` is set, of the head at that cut."""
    prefixes = tuple(f"block{b}." for b in range(start, end))
    chosen = {k: v for k, v in weights.items() if k.startswith(prefixes)}
    if head is not None:
        chosen |= {k: v for k, v in weights.items() if k.startswith(f"head{head}.")}
    return chosen


def route(
    edges: Sequence[Assignment], servers: Sequence[Assignment]
) -> tuple[dict[str, str], dict[str, Route]]:
    """One round's stream layout. The servers' distinct block ranges are the pieces of the
    back, in order, each with its stream ``seg-<k>``; an edge feeds the piece its cut falls in;
    a piece hears its edges and, when the piece before it hears anyone, that piece's servers.

    Returns the stream of each edge and, for each server, (senders, peers sharing its piece,
    its stream, the next piece's stream or None)."""
    spans = sorted({span(b) for b in servers})
    names = {s: f"seg-{index}" for index, s in enumerate(spans)}

    def piece(cut: int) -> tuple[int, int]:
        for candidate in spans:
            if candidate[0] <= cut < candidate[1]:
                return candidate
        raise ValueError(
            f"no GPU server piece holds the blocks after cut {cut}; pieces: {spans} "
            "(plan the servers from the shallowest cut)"
        )

    streams = {e.device: names[piece(e.end)] for e in edges}
    senders: dict[tuple[int, int], list[str]] = {
        s: [e.device for e in edges if piece(e.end) == s] for s in spans
    }
    for before, after in itertools.pairwise(spans):
        if senders[before]:
            senders[after] += [b.device for b in servers if span(b) == before]
    routes = {}
    for back in servers:
        own = span(back)
        index = spans.index(own)
        forward = names[spans[index + 1]] if index + 1 < len(spans) else None
        peers = [b.device for b in servers if span(b) == own]
        routes[back.device] = (senders[own], peers, names[own], forward)
    return streams, routes


def build_task(
    config: RunConfig,
    assignment: Assignment,
    session: str,
    segment: str = "seg-0",
    server_route: Route | None = None,
    servers: Sequence[str] = (),
) -> Task:
    """The task ``assignment``'s device gets; ``server_route`` for a GPU server's round,
    ``servers`` for an edge's (those serving its stream: it stops waiting for credits when
    one goes offline). The run's model and training sections travel as they are; the rest is
    the device's own."""
    edges: Sequence[str] = ()
    peers: Sequence[str] = servers
    forward = None
    if server_route is not None:
        edges, peers, segment, forward = server_route
    return Task(
        run=config.run_id,
        model=config_to_dict(config.model),
        training=config.training.to_dict(),
        start=assignment.start,
        end=assignment.end,
        estimated_peak_bytes=assignment.estimate,
        segment=segment,
        edges=tuple(edges),
        servers=tuple(peers),
        forward=forward,
        session=session,
    )


def build_message(
    grid: Grid,
    node: int,
    arrays: ArrayRecord,
    kind: str,
    number: int = 0,
    task: Task | None = None,
    options: Mapping[str, Any] | None = None,
) -> Message:
    """A ``kind`` message to ``node``: ``arrays`` and a config record with the strategy's
    ``options`` (e.g. FedProx's ``proximal-mu``), the round and the device's ``task``."""
    config = ConfigRecord(dict(options or {}))
    config["server-round"] = number
    if task is not None:
        config["task"] = task.to_json()
    content = RecordDict({"arrays": arrays, "config": config})
    return grid.create_message(content, kind, node, "edgesplit")
