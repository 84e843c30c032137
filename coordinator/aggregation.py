"""Aggregation across heterogeneous splits, as a Flower strategy chosen by name.

Edges with different split points send different subsets of the model's tensors (keys such as
``block3.0.weight`` or ``head2.net.1.weight``). Each tensor is aggregated over exactly the
replicas that trained it in this round; a local-loss head is keyed by its cut, so heads are
averaged among the devices sharing that cut; a tensor nobody trained keeps its current value.

Flower's strategies expect every reply to carry the same keys, so the configured strategy is
applied in one of three ways:

- ``fedavg``, ``fedprox``: the example-weighted mean per tensor (:func:`split_weighted_mean`);
- ``fedadam``, ``fedyogi``, ``fedadagrad``, ``fedavgm`` (server-side optimizers): that mean,
  completed with the current values, is handed to the strategy as one reply, so its own
  server update runs unchanged;
- ``fedmedian``, ``fedtrimmedavg``, ``krum``, ``multikrum``, ``bulyan`` (robust rules): the
  strategy aggregates each group of tensors held by the same set of replicas (with mixed cuts,
  the blocks every replica holds form one group, the deeper blocks smaller ones). A group too
  small for the rule (Krum and Multi-Krum need ``2f + 3`` replicas to tolerate ``f``
  Byzantine ones, Bulyan ``4f + 3``; a trimmed mean of fewer than ``1 / beta`` replicas trims
  nothing) is aggregated by the coordinate-wise median instead, and the strategy says so in
  ``notes`` (the coordinator records each note as a run event).

Before any of these, the norm bound of :mod:`coordinator.bounds` clips an update far larger
than its group's (``norm_bound``, an option of every strategy; each clip is named in
``clips``), and the runner has capped each edge's weight (``examples_bound``).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import (
    Bulyan,
    FedAdagrad,
    FedAdam,
    FedAvg,
    FedAvgM,
    FedMedian,
    FedProx,
    FedTrimmedAvg,
    FedYogi,
    Krum,
    MultiKrum,
)

from coordinator.bounds import (
    EXAMPLES_BOUND,
    NORM_BOUND,
    STATISTICS,
    bound_replica,
    norm_limit,
    plausible_limit,
    update_norm,
)
from coordinator.strategy_options import check_options
from split_models.errors import ConfigError
from wire.flower import array_numpy, array_record, numpy_arrays

__all__ = [
    "STRATEGIES",
    "build_strategy",
    "check_strategy",
    "configured_strategy",
    "flower_quiet",
    "is_robust",
    "key_groups",
    "split_weighted_mean",
]

_MEAN: dict[str, type[FedAvg]] = {"fedavg": FedAvg, "fedprox": FedProx}
_SERVER_STEP: dict[str, type[FedAvg]] = {
    "fedadam": FedAdam,
    "fedyogi": FedYogi,
    "fedadagrad": FedAdagrad,
    "fedavgm": FedAvgM,
}
_PER_GROUP: dict[str, type[FedAvg]] = {
    "fedmedian": FedMedian,
    "fedtrimmedavg": FedTrimmedAvg,
    "krum": Krum,
    "multikrum": MultiKrum,
    "bulyan": Bulyan,
}
STRATEGIES = (*_MEAN, *_SERVER_STEP, *_PER_GROUP)
WEIGHT_KEY = "num-examples"
_MIN_WEIGHT = 1e-9
_BOUNDS = {"norm_bound": NORM_BOUND, "examples_bound": EXAMPLES_BOUND}  # edgesplit's options


def split_weighted_mean(
    replicas: Sequence[Mapping[str, np.ndarray]],
    weights: Sequence[float],
    current: Mapping[str, np.ndarray],
) -> dict[str, np.ndarray]:
    """Per tensor, the ``weights``-weighted mean over the replicas that hold it.

    Tensors in ``current`` that no replica holds keep their current value. A replica may not
    send a tensor the model does not have, nor one of another shape.
    """
    if len(replicas) != len(weights):
        raise ValueError("one weight per replica is needed")
    totals: dict[str, np.ndarray] = {}
    mass: dict[str, float] = {}
    for replica, weight in zip(replicas, weights, strict=True):
        if weight < 0 or not np.isfinite(weight):
            raise ValueError(f"replica weights must be finite and >= 0, got {weight}")
        for key, array in replica.items():
            if key not in current:
                raise ValueError(f"a replica sent {key!r}, which the model does not have")
            if array.shape != current[key].shape:
                raise ValueError(
                    f"{key!r} has shape {array.shape}, the model has {current[key].shape}"
                )
            contribution = array.astype(np.float64) * weight
            totals[key] = totals[key] + contribution if key in totals else contribution
            mass[key] = mass.get(key, 0.0) + weight
    result = {}
    for key, value in current.items():
        if mass.get(key, 0.0) > 0:
            result[key] = (totals[key] / mass[key]).astype(value.dtype)
        else:
            result[key] = np.array(value, copy=True)
    return result


def key_groups(replicas: Sequence[Mapping[str, object]]) -> dict[tuple[int, ...], list[str]]:
    """Tensor keys grouped by the (sorted) indices of the replicas that hold them."""
    holders: dict[str, list[int]] = {}
    for index, replica in enumerate(replicas):
        for key in replica:
            holders.setdefault(key, []).append(index)
    groups: dict[tuple[int, ...], list[str]] = {}
    for key, indices in holders.items():
        groups.setdefault(tuple(indices), []).append(key)
    return groups


def _weight(message: Message) -> float:
    (metrics,) = message.content.metric_records.values()
    return float(metrics[WEIGHT_KEY])  # type: ignore[arg-type]


def _reply_like(template: Message, arrays: Mapping[str, np.ndarray]) -> Message:
    """A reply with ``template``'s metadata and weight and the given arrays (only the weight
    of the metrics: Flower refuses replies whose metric keys differ, as an edge's and a GPU
    server's do). A weight of 0 counts as :data:`_MIN_WEIGHT`: Flower's rules divide by the sum
    of the weights."""
    metrics = MetricRecord({WEIGHT_KEY: max(_weight(template), _MIN_WEIGHT)})
    content = RecordDict({"arrays": array_record(arrays), "metrics": metrics})
    reply = Message(content=content, reply_to=template)
    reply.metadata.__dict__["_src_node_id"] = template.metadata.src_node_id
    return reply


def _split_aware(base: type[FedAvg], mode: str) -> type[FedAvg]:
    class SplitAware(base):  # type: ignore[valid-type, misc]
        """``base`` with aggregation over exactly the replicas that trained each tensor."""

        _current: dict[str, np.ndarray] | None = None
        notes: list[str] = []  # noqa: RUF012 (replaced per round): groups aggregated otherwise
        clips: list[tuple[str, str]] = []  # noqa: RUF012 (per round): (device, why) clipped
        node_names: dict[int, str] = {}  # noqa: RUF012 (set by the runner): for the notes
        trusted_nodes: frozenset[int] = frozenset()  # set by the runner: the GPU servers
        mirrors: dict[str, str] = {}  # noqa: RUF012 (set by the runner): head -> the back's
        norm_bound, examples_bound = NORM_BOUND, EXAMPLES_BOUND  # options of build_strategy

        def _robust(
            self, server_round: int, replies: list[Message], group: list[dict[str, np.ndarray]]
        ) -> dict[str, np.ndarray]:
            """One group of replicas holding the same tensors, by the rule or its fallback."""
            fallback = _median_if_too_few(self, replies, group)
            if fallback is not None:
                return fallback
            messages = [_reply_like(m, g) for m, g in zip(replies, group, strict=True)]
            arrays, _ = super().aggregate_train(server_round, messages)
            return {} if arrays is None else {k: array_numpy(v) for k, v in arrays.items()}

        def configure_train(
            self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
        ) -> Iterable[Message]:
            self._current = _rekey(self, arrays)
            return super().configure_train(server_round, arrays, config, grid)  # type: ignore[no-any-return]

        def aggregate_train(
            self, server_round: int, replies: Iterable[Message]
        ) -> tuple[ArrayRecord | None, MetricRecord | None]:
            valid = [m for m in replies if not m.has_error()]
            if not valid or self._current is None:
                return super().aggregate_train(server_round, valid)  # type: ignore[no-any-return]
            self.notes, self.clips = [], []
            replicas, metrics = _bound_updates(self, valid), _train_metrics(self, valid)
            if mode == "per_group":
                merged = _per_group(self, server_round, valid, replicas)
                return array_record(_mirrored(self, merged)), metrics
            mean = split_weighted_mean(replicas, [_weight(m) for m in valid], self._current)
            if mode == "mean":
                return array_record(_mirrored(self, mean)), metrics
            arrays, _ = super().aggregate_train(server_round, [_reply_like(valid[0], mean)])
            return _settled(self, arrays, mean), metrics

    SplitAware.__name__ = SplitAware.__qualname__ = f"SplitAware{base.__name__}"
    return SplitAware


def _mirrors(strategy: Any) -> dict[str, str]:
    """The mirrored heads to aggregate as the back's replicas: none under a robust rule, where
    the edges' heads would outvote (krum: replace) the GPU servers' one replica, trained on
    every edge's batches."""
    return {} if is_robust(strategy) else dict(strategy.mirrors)


def _mirrored(strategy: Any, merged: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """``merged`` with each mirrored head (``strategy.mirrors``) set to the back's tensor it
    is a replica of: the edges' trained heads were averaged into the back's, so the stored
    head follows it (it is sent as the back's next round anyway)."""
    for head, back in _mirrors(strategy).items():
        if head in merged and back in merged:
            merged[head] = merged[back].copy()
    return merged


def _per_group(
    strategy: Any, server_round: int, valid: list[Message], replicas: list[dict[str, np.ndarray]]
) -> dict[str, np.ndarray]:
    """The round's weights with each group of replicas holding the same tensors aggregated by
    ``strategy``'s rule, in the model's dtypes as the mean keeps them: Flower's rules return
    BatchNorm's int64 batch count as float64, which the next round's replies (int64 again)
    would not match."""
    merged = {k: np.array(v, copy=True) for k, v in strategy._current.items()}
    for indices, keys in key_groups(replicas).items():
        group = [{k: replicas[i][k] for k in keys} for i in indices]
        robust = strategy._robust(server_round, [valid[i] for i in indices], group)
        merged.update({k: v.astype(merged[k].dtype, copy=False) for k, v in robust.items()})
    return merged


def _settled(
    strategy: Any, arrays: ArrayRecord | None, mean: Mapping[str, np.ndarray]
) -> ArrayRecord | None:
    """A server step's result with the running statistics of normalisation layers set to
    their average over the replicas, and every tensor in the model's dtype (FedAdam's float64
    step size made float32 weights float64: twice the bytes on the wire)."""
    if arrays is None:
        return None
    current = strategy._current
    settled = {}
    for key, array in arrays.items():
        # what normalisation layers track rather than learn takes the plain mean: a server
        # step (momentum, moments) on it is no gradient step, and FedAvgM's took running
        # variances below zero (NaN)
        value = mean[key] if key.rsplit(".", 1)[-1] in STATISTICS else array_numpy(array)
        settled[key] = np.asarray(value).astype(current[key].dtype, copy=False)
    record = array_record(_mirrored(strategy, settled))
    if isinstance(getattr(strategy, "current_arrays", None), ArrayRecord):
        strategy.current_arrays = record  # FedAvgM steps next from the weights it returned
    return record


def _bound_updates(strategy: Any, replies: list[Message]) -> list[dict[str, np.ndarray]]:
    """The replicas ``replies`` hold, with every update whose norm is above
    ``strategy.norm_bound`` times the median of its group (the replicas holding the same
    tensors) clipped onto that bound (the norm bound of :mod:`coordinator.bounds`), and one
    beyond :func:`~coordinator.bounds.plausible_limit` kept at the round's start, in a group
    of any size; each named in ``strategy.clips``. Trusted replicas (the GPU servers) count
    towards the median but are never clipped."""
    mirrors = _mirrors(strategy)  # an edge's head that is the back's classifier is a replica
    received = [numpy_arrays(m, key=None) for m in replies]
    replicas = [{mirrors.get(k, k): v for k, v in r.items()} for r in received]
    start, bounded = strategy._current, [dict(r) for r in replicas]
    for indices, keys in key_groups(replicas).items():
        group = [{k: replicas[i][k] for k in keys} for i in indices]
        norms = [update_norm(g, start) for g in group]
        plausible = plausible_limit(list(keys), start) if strategy.norm_bound else math.inf
        limits = (norm_limit(norms, strategy.norm_bound), plausible)
        for i, tensors, norm in zip(indices, group, norms, strict=True):
            node = replies[i].metadata.src_node_id
            if node in strategy.trusted_nodes:
                continue
            device = strategy.node_names.get(node, f"node {node}")
            named = f"{device}'s update of {_describe(tensors)}"
            limited = (len(group), *limits)
            clipped, why = bound_replica(tensors, start, norm, limited, named, strategy.norm_bound)
            if clipped is not None:
                bounded[i].update(clipped)
                strategy.clips.append((device, why))
    return bounded


def _rekey(strategy: Any, arrays: ArrayRecord) -> dict[str, np.ndarray]:
    """``arrays`` as NumPy, with the server-side optimizer state brought to their tensors (a
    re-plan adds local heads for its new cuts): FedOpt's moments (kept by name) start at zero
    for a new tensor; FedAvgM, whose momentum is kept by position, starts again when the
    tensors change and follows them when only their order does."""
    keys = list(arrays.keys())
    for name in ("m_t", "v_t"):
        state = getattr(strategy, name, None)
        if isinstance(state, dict) and state and set(state) != set(keys):
            setattr(
                strategy,
                name,
                {
                    k: state[k] if k in state else np.zeros_like(array_numpy(arrays[k]))
                    for k in keys
                },
            )
    current = getattr(strategy, "current_arrays", None)
    if isinstance(current, ArrayRecord) and list(current.keys()) != keys:
        momentum = getattr(strategy, "momentum_vector", None)
        if set(current.keys()) != set(keys):
            strategy.current_arrays, strategy.momentum_vector = arrays, None
        else:  # the same tensors in another order (a resumed run's): its state follows
            if momentum is not None:
                by_key = dict(zip(current.keys(), momentum, strict=True))
                strategy.momentum_vector = [by_key[k] for k in keys]
            strategy.current_arrays = ArrayRecord({k: current[k] for k in keys})
    return {key: array_numpy(value) for key, value in arrays.items()}


def _train_metrics(strategy: Any, replies: list[Message]) -> MetricRecord:
    """The replies' numeric metrics that every reply holds, weighted by their examples (none
    when every weight is 0: an edge capped to what the GPU servers trained may have none).
    Lists (a device's timed steps per cut) are left out: Flower averages them element by
    element, and lists of different lengths, from devices at different cuts or from a device
    that lies, would fail the round."""
    if sum(_weight(m) for m in replies) <= 0:
        return MetricRecord()
    records = [m.content.metric_records["metrics"] for m in replies]
    common = set.intersection(*(set(r) for r in records))
    scalars = [
        RecordDict(
            {
                "metrics": MetricRecord(
                    {k: v for k, v in r.items() if k in common and not isinstance(v, list)}
                )
            }
        )
        for r in records
    ]
    return strategy.train_metrics_aggr_fn(scalars, WEIGHT_KEY)  # type: ignore[no-any-return]


def _median_if_too_few(
    strategy: Any, replies: list[Message], group: list[dict[str, np.ndarray]]
) -> dict[str, np.ndarray] | None:
    """The coordinate-wise median of ``group`` when it is too small for ``strategy``'s rule
    (noted in ``strategy.notes``), else None."""
    needed = _group_minimum(strategy)
    if len(group) >= needed:
        return None
    names = getattr(strategy, "node_names", {})
    senders = ", ".join(
        names.get(m.metadata.src_node_id, f"node {m.metadata.src_node_id}") for m in replies
    )
    rule = type(strategy).__name__.removeprefix("SplitAware").lower()
    if len(group) == 1:  # the median of one is that one: say what it is
        strategy.notes.append(
            f"{rule}: {senders} alone holds {_describe(group[0])}: taken as it is (no rule "
            "can judge a single replica)"
        )
        return {k: v.copy() for k, v in group[0].items()}
    strategy.notes.append(
        f"{rule}: {len(group)} "
        f"replica(s) ({senders}) hold {_describe(group[0])}, fewer than the {needed} "
        "the rule needs; aggregated by the coordinate-wise median instead"
    )
    return {
        k: np.median(np.stack([g[k] for g in group]), axis=0).astype(group[0][k].dtype)
        for k in group[0]
    }


def is_robust(strategy: FedAvg) -> bool:
    """Whether ``strategy`` is one of the robust rules (it judges each reply)."""
    return isinstance(strategy, tuple(_PER_GROUP.values()))


def _group_minimum(strategy: FedAvg) -> int:
    """How many replicas the robust rule of ``strategy`` needs to do what it says."""
    byzantine = int(getattr(strategy, "num_malicious_nodes", 0))
    if isinstance(strategy, Bulyan):
        return 4 * byzantine + 3
    if isinstance(strategy, MultiKrum):  # Krum is a MultiKrum selecting one
        return 2 * byzantine + 3
    if isinstance(strategy, FedTrimmedAvg):
        beta = float(strategy.beta)
        return 1 if beta == 0 else int(np.ceil(1 / beta))
    return 1


def _describe(tensors: Mapping[str, object]) -> str:
    """``block2.*, block3.*`` for a group's tensor keys (by their first name part)."""
    names = sorted({key.split(".", 1)[0] for key in tensors})
    return ", ".join(f"{name}.*" for name in names)


@contextlib.contextmanager
def flower_quiet(level: int = logging.WARNING) -> Iterator[None]:
    """Flower's logger passes only ``level`` and above while this is held (its strategies log
    each round's sampling at INFO), then gets its own level back."""
    flower = logging.getLogger("flwr")
    before = flower.level
    flower.setLevel(max(level, flower.getEffectiveLevel()))
    try:
        yield
    finally:
        flower.setLevel(before)


def configured_strategy(
    name: str, options: Mapping[str, Any], fraction_evaluate: float = 0.0
) -> tuple[FedAvg, int]:
    """The run's strategy ``name`` with its ``options``, and the trained devices a round
    needs (its ``min_train_nodes``, default 1). The node counts given to Flower are the
    coordinator's own: it samples among the devices online, which it waited for."""
    options = dict(options)
    min_trained = int(options.pop("min_train_nodes", 1))
    options.pop("min_available_nodes", None)
    options.setdefault("fraction_evaluate", fraction_evaluate)
    options.setdefault("min_evaluate_nodes", 1)
    strategy = build_strategy(name, min_available_nodes=1, min_train_nodes=1, **options)
    return strategy, min_trained


def check_strategy(name: str, options: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` naming the option when ``options`` do not build ``name``
    (the coordinator's own node counts aside, which it sets itself)."""
    own = {"min_train_nodes", "min_available_nodes"}
    build_strategy(name, **{k: v for k, v in options.items() if k not in own})


def build_strategy(name: str, quiet: bool = True, **options: Any) -> FedAvg:
    """A split-aware Flower strategy by name, e.g. ``build_strategy("fedadam", eta=0.01)``;
    ``quiet``: Flower logs only errors while it is built (it warns, for one, that federated
    evaluation is off)."""
    with flower_quiet(logging.ERROR if quiet else logging.NOTSET):
        return _build_strategy(name, options)


# Defaults of edgesplit's own where Flower's do not train: FedAdagrad's and FedAdam's server
# step of 0.1 took the cnn to a loss of hundreds in round 1 on the digits (the guard then
# refuses the round); 0.01 is FedYogi's default.
_DEFAULTS: dict[str, dict[str, Any]] = {"fedadagrad": {"eta": 0.01}, "fedadam": {"eta": 0.01}}


def _taken(strategy: type) -> str:
    """``; it takes a, b, c``: the options a strategy class accepts, and edgesplit's bounds
    (callbacks, record keys and the node counts the coordinator sets itself left out)."""
    own = {"self", "min_train_nodes", "min_available_nodes", "min_evaluate_nodes"}
    names = sorted(
        {
            p.name
            for p in inspect.signature(strategy).parameters.values()
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
            and p.name not in own
            and not p.name.endswith(("_fn", "_key"))
        }
        | set(_BOUNDS)
    )
    return f"; it takes {', '.join(names)}" if names else ""


def _build_strategy(name: str, options: dict[str, Any]) -> FedAvg:
    key = name.lower()
    options = _DEFAULTS.get(key, {}) | options
    check_options(name, options)
    bounds = {option: _bound(name, option, options.pop(option, d)) for option, d in _BOUNDS.items()}
    for mode, table in (("mean", _MEAN), ("server_step", _SERVER_STEP), ("per_group", _PER_GROUP)):
        if key in table:
            try:
                strategy = _split_aware(table[key], mode)(**options)
            except (TypeError, ValueError) as error:  # an unknown option, or a bad value
                taken = _taken(table[key])
                raise ConfigError(f"strategy {name!r}: bad option: {error}{taken}") from error
            strategy.__dict__.update(bounds)
            return strategy
    raise ConfigError(f"strategy.name: unknown {name!r}; use one of {list(STRATEGIES)}")


def _bound(name: str, option: str, value: object) -> float:
    """``norm_bound`` or ``examples_bound``: 0 (off) or a factor of at least 1."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (value == 0 or 1 <= value < float("inf"))
    ):
        raise ConfigError(
            f"strategy {name!r}: {option}: expected 0 (off) or a number >= 1, got {value!r}"
        )
    return float(value)
