"""Memory-sized partitioning: choose each edge's split point and place the back on GPU servers.

Cost model of one training step of the whole system (every edge trains one batch):

- edge ``e`` with split ``s`` trains blocks ``[0, s)`` and its local-loss head:
  ``compute = 3 * B * flops(0..s + head) / flops_e`` (forward + backward ~ 3x forward) and
  ``upload = B * cut_bytes(s) / uplink_e``; streaming overlaps them, so ``t_e = max(both)``,
  plus its share of the round's weight traffic when its batches a round ``n_e`` are known:
  ``2 * weight_bytes(0..s + head) / uplink_e / n_e`` (the segment comes down and goes back up
  once a round; the downlink is taken to be as fast as the uplink);
- the GPU servers train ``[s_e, N)`` on every edge's batch, sharing the load:
  ``T_server = 3 * B * sum_e flops(s_e..N) / sum_g flops_g``;
- a step takes ``max(max_e t_e, T_server)``, which the plan minimises.

Constraints: each edge's prefix (with its head) fits its memory, ``s_e >= min_edge_blocks``,
and the back blocks ``[min_e s_e, N)`` can be cut into contiguous pieces that fit the servers.

Exactness: for a threshold ``T`` the best edge choice is, per edge, the largest feasible split
with ``t_e <= T`` (a larger split only lowers server work). Sweeping ``T`` over all ``E * N``
candidate edge times in sorted order therefore visits an optimal plan; the sweep is
``O(E N log(E N))``. Server packing is an exact DP over server subsets (up to 10 servers; beyond
that, by decreasing memory). ``cuts: uniform`` (:class:`PartitionConfig`) asks for one split
shared by every edge: each split every edge can hold is tried, ``O(E N)``; it is the classic
SplitFed set-up, the baseline of per-device cuts (``benchmarks/heterogeneity.py --mix memory``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations

import numpy as np

from coordinator.plan_config import COMPRESSION_BYTES as COMPRESSION_BYTES
from coordinator.plan_config import ENCODE_WORK
from coordinator.plan_config import PartitionConfig as PartitionConfig
from split_models.devices import DeviceSpec
from split_models.errors import ConfigError, InfeasiblePlanError, ModelError, ServersTooSmall
from split_models.memory import estimate_segment_memory, segment_memory_table
from split_models.plan import EdgeAssignment, Plan, ServerAssignment
from split_models.profiler import ModelProfile
from split_models.units import format_bytes

__all__ = [
    "COMPRESSION_BYTES",
    "PartitionConfig",
    "Problem",
    "place_back",
    "plan_split",
    "step_seconds",
    "stream_buffer_bytes",
]

TRAIN_FLOPS_FACTOR = 3
LABEL_BYTES = 8
STREAM_COPIES = 3
STREAM_FIXED_BYTES = 512 * 1024
_MAX_EXACT_SERVERS = 10


@dataclass(frozen=True)
class Problem:
    """Everything the search needs, as plain arrays indexed by split point ``s`` (0..N)."""

    num_blocks: int
    memory: list[list[int]]  # memory[a][b]: estimated peak of segment [a, b) with its head
    edge_memory: list[int]  # edge_memory[s]: memory[0][s] plus the stream's send buffers
    edge_flops: np.ndarray  # forward FLOPs/sample of blocks [0, s) plus the head at s
    server_flops: np.ndarray  # forward FLOPs/sample of blocks [s, N)
    cut_bytes: np.ndarray  # bytes/sample sent at cut s (activations + label)
    batch_size: int
    min_edge_blocks: int
    # bytes of the state (parameters, buffers) of blocks [0, s) and the head at s: down and
    # up once a round
    edge_weight_bytes: np.ndarray | None = None

    @classmethod
    def build(cls, profile: ModelProfile, config: PartitionConfig) -> Problem:
        if profile.num_blocks < 2:
            raise ModelError(
                f"model {profile.model!r} has {profile.num_blocks} block; it needs at least 2 "
                "to be split between edges and servers: use a model of several layers, name "
                "split_points inside it, or train it whole (--method centralized or fedavg)"
            )
        if config.min_edge_blocks > profile.num_blocks - 1:
            raise ConfigError(
                f"min_edge_blocks: {config.min_edge_blocks} leaves no block for the servers "
                f"of a {profile.num_blocks}-block model; use at most {profile.num_blocks - 1}"
            )
        if config.local_loss not in profile.heads:
            raise ConfigError(f"local_loss: {config.local_loss!r} heads were not profiled")
        flops = np.array([0] + [b.flops for b in profile.blocks], dtype=np.float64)
        prefix = np.cumsum(flops)
        heads = profile.heads[config.local_loss][: profile.num_blocks]  # none after the last
        # a backprop edge computes no head (its weights still travel: every edge gets one)
        head_flops = np.array([h.flops if config.head else 0 for h in heads] + [0], np.float64)
        # what a segment's state crosses the link as: parameters and buffers (BatchNorm's
        # running statistics travel with the weights)
        weights = np.cumsum([0] + [b.param_bytes + b.buffer_bytes for b in profile.blocks])
        head_weights = [h.param_bytes + h.buffer_bytes for h in heads] + [0]
        ratio = COMPRESSION_BYTES[config.compression] / 4.0
        cut = np.array(
            [0.0]
            + [math.ceil(b.output_bytes * ratio) + profile.label_bytes for b in profile.blocks]
        )
        memory = segment_memory_table(
            profile, config.batch_size, config.optimizer, config.head, config.anchor
        )
        return cls(
            num_blocks=profile.num_blocks,
            memory=memory,
            edge_memory=_edge_memory(profile, config, memory, cut),
            edge_flops=prefix + head_flops,
            server_flops=prefix[-1] - prefix,
            cut_bytes=cut,
            batch_size=config.batch_size,
            min_edge_blocks=config.min_edge_blocks,
            edge_weight_bytes=(weights + np.array(head_weights)).astype(np.float64),
        )


def _edge_memory(
    profile: ModelProfile, config: PartitionConfig, memory: list[list[int]], cut: np.ndarray
) -> list[int]:
    """Each split's edge peak: the segment's step, the stream's send buffers and, in backprop
    mode, the codec's working copy (a backprop edge compresses its batch while the forward
    graph is held, at its peak; a local-loss edge sends after its step, in the room the freed
    graph leaves)."""
    work = ENCODE_WORK[config.compression] if config.mode == "backprop" else 0.0
    return [
        memory[0][s]
        + stream_buffer_bytes(int(cut[s]), config.batch_size)
        + math.ceil(work * profile.blocks[s - 1].output_bytes * config.batch_size)
        if s
        else 0
        for s in range(profile.num_blocks + 1)
    ]


def stream_buffer_bytes(cut_bytes_per_sample: int, batch_size: int) -> int:
    """What an edge holds to send one batch of activations beyond the training step: the
    encoded copy, the serialised message and the transport's packet can coexist, so three
    payloads, plus the codec's fixed buffers (measured on the edge agent over mosquitto: for
    cnn's first cut at batch 32 in fp16, 1.5 MiB payloads, the round peaked 5.2 MiB above the
    training step's estimate)."""
    return STREAM_COPIES * cut_bytes_per_sample * batch_size + STREAM_FIXED_BYTES


# ---------------------------------------------------------------- servers: contiguous packing


def _server_order(servers: Sequence[DeviceSpec]) -> list[int]:
    return sorted(range(len(servers)), key=lambda g: (-servers[g].memory, servers[g].name))


def _fits(problem: Problem, servers: Sequence[DeviceSpec]) -> np.ndarray:
    """fits[g, a, b]: segment [a, b) fits server g's memory."""
    size = problem.num_blocks + 1
    table = np.array(problem.memory, dtype=np.float64)
    empty = np.tril(np.ones((size, size), dtype=bool))  # b <= a is not a segment
    budgets = np.array([s.memory for s in servers], dtype=np.float64)
    return (table[None, :, :] <= budgets[:, None, None]) & ~empty[None, :, :]


def _packing(problem: Problem, servers: Sequence[DeviceSpec]) -> dict[int, np.ndarray]:
    """finish[mask][a]: the servers in ``mask`` can hold blocks [a, N) in contiguous pieces."""
    size, count = problem.num_blocks + 1, len(servers)
    fits = _fits(problem, servers).astype(np.int32)
    done = np.zeros(size, dtype=bool)
    done[-1] = True
    finish = {0: done}
    if count > _MAX_EXACT_SERVERS:  # fixed order: each prefix of the order is one "mask"
        mask = 0
        for g in reversed(_server_order(servers)):
            previous = finish[mask]
            mask |= 1 << g
            finish[mask] = previous | ((fits[g] @ previous.astype(np.int32)) > 0)
        return {(1 << count) - 1: finish[mask], **finish}
    for subset_size in range(1, count + 1):
        for subset in combinations(range(count), subset_size):
            mask = sum(1 << g for g in subset)
            reach = done.copy()
            for g in subset:
                reach |= (fits[g] @ finish[mask & ~(1 << g)].astype(np.int32)) > 0
            finish[mask] = reach
    return finish


def _place_servers(
    problem: Problem, servers: Sequence[DeviceSpec], finish: dict[int, np.ndarray], start: int
) -> list[tuple[int, int, int]]:
    """Pieces (server index, a, b) covering [start, N), fewest servers first."""
    full = (1 << len(servers)) - 1
    fits = _fits(problem, servers)
    pieces, position, mask = [], start, full
    while position < problem.num_blocks:
        for g in _server_order(servers):
            if not mask & (1 << g):
                continue
            rest = mask & ~(1 << g)
            ends = [
                b
                for b in range(problem.num_blocks, position, -1)
                if fits[g, position, b] and finish.get(rest, finish[0])[b]
            ]
            if ends:
                pieces.append((g, position, ends[0]))
                position, mask = ends[0], rest
                break
        else:
            raise AssertionError(f"no server piece from block {position} despite feasibility")
    return pieces


def place_back(
    profile: ModelProfile, servers: Sequence[DeviceSpec], config: PartitionConfig, start: int
) -> tuple[ServerAssignment, ...]:
    """Contiguous pieces of the back ``[start, N)`` on ``servers``, fewest first, for edges
    that keep their cuts; :class:`InfeasiblePlanError` when they cannot hold it."""
    problem = Problem.build(profile, config)
    packing = _packing(problem, servers)
    if not servers or not packing[(1 << len(servers)) - 1][start]:
        room, n = format_bytes(sum(s.memory for s in servers)), problem.num_blocks
        raise InfeasiblePlanError(f"servers with {room} in all cannot hold blocks [{start}, {n})")
    return tuple(
        ServerAssignment(servers[g].name, (a, b), problem.memory[a][b], servers[g].memory)
        for g, a, b in _place_servers(problem, servers, packing, start)
    )


# ---------------------------------------------------------------- edges: threshold sweep


def _edge_times(problem: Problem, edges: Sequence[DeviceSpec]) -> np.ndarray:
    """times[e, s]: estimated seconds of one batch on edge e with split s, with its share of
    the round's weight traffic (down and up, over the uplink's rate) when the edge's batches
    a round are known."""
    flops = np.array([e.flops for e in edges])[:, None]
    uplink = np.array([e.uplink or math.inf for e in edges])[:, None]
    batch = problem.batch_size
    compute = TRAIN_FLOPS_FACTOR * batch * problem.edge_flops[None, :] / flops
    times: np.ndarray = np.maximum(compute, batch * problem.cut_bytes[None, :] / uplink)
    if problem.edge_weight_bytes is not None:
        per_round = np.array([e.round_batches or math.inf for e in edges], dtype=np.float64)
        times = times + 2 * problem.edge_weight_bytes[None, :] / uplink / per_round[:, None]
    return times


def _server_rate(problem: Problem, servers: Sequence[DeviceSpec]) -> float:
    """Seconds of server time per FLOP/sample of back work per edge batch."""
    return TRAIN_FLOPS_FACTOR * problem.batch_size / sum(s.flops for s in servers)


def _sweep(times: np.ndarray, allowed: np.ndarray, work: np.ndarray, rate: float) -> list[int]:
    """Split per edge minimising max(max_e t_e, rate * sum_e work[s_e]) over allowed splits."""
    edge_index, split_index = np.nonzero(allowed)
    candidate_times = times[edge_index, split_index]
    order = np.argsort(candidate_times, kind="stable")
    ts = candidate_times[order].tolist()
    es, ss = edge_index[order].tolist(), split_index[order].tolist()
    work_list = work.tolist()
    best = [-1] * times.shape[0]
    load, assigned, total = 0.0, 0, len(best)
    best_objective, best_stop = math.inf, 0
    i = 0
    while i < len(ts):
        threshold, j = ts[i], i
        while j < len(ts) and ts[j] == threshold:
            e, s = es[j], ss[j]
            if s > best[e]:
                load += work_list[s] - (work_list[best[e]] if best[e] >= 0 else 0.0)
                assigned += best[e] < 0
                best[e] = s
            j += 1
        if assigned == total:
            objective = max(threshold, rate * load)
            if objective < best_objective:
                best_objective, best_stop = objective, j
            if threshold >= rate * load:
                break  # larger thresholds only raise the edge term
        i = j
    choice = [-1] * total
    for k in range(best_stop):
        choice[es[k]] = max(choice[es[k]], ss[k])
    return choice


def _uniform(times: np.ndarray, allowed: np.ndarray, work: np.ndarray, rate: float) -> list[int]:
    """One split for every edge, minimising the same step time. Each edge's allowed splits are
    those under its memory budget (from the same lowest split), so the sets are nested and the
    smallest one is common to all."""
    common = np.nonzero(allowed.all(axis=0))[0]
    steps = [max(float(times[:, s].max()), rate * times.shape[0] * float(work[s])) for s in common]
    best = int(common[int(np.argmin(steps))])
    return [best] * times.shape[0]


def step_seconds(
    problem: Problem,
    edges: Sequence[DeviceSpec],
    servers: Sequence[DeviceSpec],
    splits: Sequence[int],
) -> float:
    """The cost model's step time of a given assignment of splits (for tests and reports)."""
    times = _edge_times(problem, edges)
    edge_time = max(times[e, s] for e, s in enumerate(splits))
    server = _server_rate(problem, servers) * sum(problem.server_flops[s] for s in splits)
    return float(max(edge_time, server))


# ---------------------------------------------------------------- errors


def _with_head(config: PartitionConfig) -> str:
    """``with a linear head``, or what a backprop segment keeps instead."""
    if config.head is None:
        return "with no head (backprop: the gradient of its output kept)"
    return f"with a {config.head} head"


def _describe(
    profile: ModelProfile, config: PartitionConfig, start: int, end: int, stream: int = 0
) -> str:
    estimate = estimate_segment_memory(
        profile, start, end, config.batch_size, config.optimizer, config.head, config.anchor
    )
    buffers = f", send buffers {format_bytes(stream)}" if stream else ""
    return (
        f"{format_bytes(estimate.total + stream)} at batch {config.batch_size} (weights "
        f"{format_bytes(estimate.weights)}, activations {format_bytes(estimate.activations)}, "
        f"peak of the step {format_bytes(estimate.step_peak)}{buffers})"
    )


def _edge_errors(
    problem: Problem,
    profile: ModelProfile,
    config: PartitionConfig,
    edges: Sequence[DeviceSpec],
    lowest: int,
) -> list[str]:
    """Why edges cannot take part, one message per reason (edges of the same memory share
    one: a fleet of thousands gets a line per profile, not per device)."""
    n, low = problem.num_blocks, config.min_edge_blocks
    groups: dict[tuple[int, int], list[str]] = {}  # (memory, largest holdable end) -> names
    for edge in edges:
        fits = (s for s in range(low, n) if problem.edge_memory[s] <= edge.memory)
        largest = max(fits, default=-1)  # -1: not even the smallest segment
        if largest < lowest:
            groups.setdefault((edge.memory, largest), []).append(edge.name)
    buffers = problem.edge_memory[low] - problem.memory[0][low]
    messages = []
    for (memory, largest), names in groups.items():
        if largest < 0:
            has, its = ("has", "its") if len(names) == 1 else ("have", "their")
            messages.append(
                f"{_names(names)} {has} {format_bytes(memory)} but {its} smallest segment, "
                f"blocks [0, {low}) {_with_head(config)}, needs "
                f"{_describe(profile, config, 0, low, buffers)}, "
                f"{format_bytes(problem.edge_memory[low] - memory)} more than it has"
                "; lower the batch size, give the device "
                "more memory, or use a model with a smaller first block"
            )
        else:
            messages.append(
                f"{_names(names)} can hold at most blocks [0, {largest}) but the GPU "
                f"servers can only hold blocks [{lowest}, {n}); add GPU server memory or lower "
                "the batch size"
            )
    return messages


def _names(names: list[str], shown: int = 3) -> str:
    """``edge 'a'``, or ``edges 'a', 'b', 'c' and 97 more``."""
    if len(names) == 1:
        return f"edge {names[0]!r}"
    listed = ", ".join(repr(n) for n in names[:shown])
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return f"{len(names)} edges ({listed}{more})"


# ---------------------------------------------------------------- entry point


def plan_split(
    profile: ModelProfile, devices: Sequence[DeviceSpec], config: PartitionConfig
) -> Plan:
    """The plan with the lowest estimated step time, or :class:`InfeasiblePlanError`."""
    edges = [d for d in devices if d.kind == "edge"]
    servers = [d for d in devices if d.kind == "gpu"]
    if not edges:
        raise InfeasiblePlanError("no edge device declared; add at least one with kind: edge")
    if not servers:
        raise InfeasiblePlanError(
            "no GPU server declared; add at least one with kind: gpu to train the back blocks"
        )
    problem = Problem.build(profile, config)
    n = problem.num_blocks
    packing = _packing(problem, servers)
    finish = packing[(1 << len(servers)) - 1]
    packable = [s for s in range(config.min_edge_blocks, n) if finish[s]]
    if not packable:
        largest = max(servers, key=lambda s: s.memory)
        raise ServersTooSmall(
            f"the GPU servers cannot hold the back of the model even from block {n - 1}: "
            f"blocks [{n - 1}, {n}) need {_describe(profile, config, n - 1, n)}, the largest "
            f"server {largest.name!r} has {format_bytes(largest.memory)}; add GPU memory or "
            "lower the batch size"
        )
    lowest = packable[0]
    budgets = np.array([e.memory for e in edges], dtype=np.float64)[:, None]
    prefix_memory = np.array(problem.edge_memory, dtype=np.float64)[None, :]
    splits = np.arange(n + 1)[None, :]
    allowed = (prefix_memory <= budgets) & (splits >= lowest) & (splits < n)
    messages = _edge_errors(problem, profile, config, edges, lowest)
    if len(messages) == 1:
        raise InfeasiblePlanError(messages[0])
    if messages:
        raise InfeasiblePlanError(
            "edge devices cannot take part:\n" + "\n".join(f"  - {m}" for m in messages)
        )
    times = _edge_times(problem, edges)
    search = _uniform if config.cuts == "uniform" else _sweep
    choice = search(times, allowed, problem.server_flops, _server_rate(problem, servers))
    return _assemble(problem, profile, config, edges, servers, packing, times, choice, lowest)


def _bottleneck(
    problem: Problem,
    edges: Sequence[DeviceSpec],
    times: np.ndarray,
    choice: list[int],
    server_time: float,
) -> tuple[float, str]:
    """The slowest edge's step time and what bounds the plan's step."""
    slowest = max(range(len(edges)), key=lambda e: times[e, choice[e]])
    edge_time, split, edge = float(times[slowest, choice[slowest]]), choice[slowest], edges[slowest]
    compute = TRAIN_FLOPS_FACTOR * problem.batch_size * problem.edge_flops[split] / edge.flops
    upload = problem.batch_size * problem.cut_bytes[split] / (edge.uplink or math.inf)
    bottleneck = (  # the larger of the two overlapping parts (the weights' share adds to both)
        "the GPU servers"
        if server_time >= edge_time
        else f"edge {edge.name!r} {'compute' if compute >= upload else 'upload'}"
    )
    return edge_time, bottleneck


def _assemble(
    problem: Problem,
    profile: ModelProfile,
    config: PartitionConfig,
    edges: Sequence[DeviceSpec],
    servers: Sequence[DeviceSpec],
    full_finish: dict[int, np.ndarray],
    times: np.ndarray,
    choice: list[int],
    lowest: int,
) -> Plan:
    shallowest = min(choice)
    host_from = shallowest if full_finish[(1 << len(servers)) - 1][shallowest] else lowest
    pieces = _place_servers(problem, servers, full_finish, host_from)
    weights = problem.edge_weight_bytes
    edge_rows = tuple(
        EdgeAssignment(
            name=edge.name,
            blocks=(0, s),
            estimated_peak_bytes=problem.edge_memory[s],
            budget_bytes=edge.memory,
            cut_bytes_per_sample=int(problem.cut_bytes[s]),
            flops_per_sample=int(problem.edge_flops[s]),
            step_seconds=float(times[e, s]),
            weight_bytes=0 if weights is None else int(weights[s]),
        )
        for e, (edge, s) in enumerate(zip(edges, choice, strict=True))
    )
    server_rows = tuple(
        ServerAssignment(servers[g].name, (a, b), problem.memory[a][b], servers[g].memory)
        for g, a, b in pieces
    )
    server_time = _server_rate(problem, servers) * float(
        sum(problem.server_flops[s] for s in choice)
    )
    edge_time, bottleneck = _bottleneck(problem, edges, times, choice, server_time)
    return Plan(
        model=profile.model,
        num_blocks=problem.num_blocks,
        batch_size=problem.batch_size,
        **{k: getattr(config, k) for k in ("optimizer", "local_loss", "compression", "mode")},
        edges=edge_rows,
        servers=server_rows,
        estimated_step_seconds=max(edge_time, server_time),
        bottleneck=bottleneck,
        input_shape=profile.input_shape,
        num_classes=profile.num_classes,
    )
