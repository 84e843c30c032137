"""The server-side optimizer state a strategy carries from round to round, kept two ways.

FedAvgM keeps a momentum of the global update, FedOpt (FedAdam, FedYogi, FedAdagrad) keeps
its first and second moments. Both shape every later round, so:

- a try that is aggregated but not committed (it diverged) must leave the state as it was
  before it: :func:`server_state` copies it, :func:`restore_server_state` puts it back;
- a restarted coordinator must go on with the state the last committed round left, not with
  none: :func:`server_tensors` gives it as named tensors for the round's checkpoint, and
  :func:`restore_server_tensors` takes them up again, checked against the resumed weights
  (a checkpoint is read back from disk: a tensor that does not fit is left out, named).

Devices keep no optimizer state across rounds (each round starts their optimizer afresh on
the aggregated weights), so this is all the optimizer state a run has between rounds.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from wire.flower import array_record

__all__ = [
    "restore_server_state",
    "restore_server_tensors",
    "server_state",
    "server_tensors",
]

# what a strategy's aggregate_train advances besides its result: FedAvgM's current weights and
# momentum, FedOpt's current weights and moments
_SERVER_STATE = ("current_arrays", "momentum_vector", "m_t", "v_t")
_MOMENTS = ("m_t", "v_t")  # FedOpt's, by tensor name
_MOMENTUM = "momentum"  # FedAvgM's, by position in its current weights: saved by their names


def server_state(strategy: Any) -> dict[str, Any]:
    """A copy of the server-side optimizer state ``strategy`` keeps between rounds, taken
    before an aggregation: a round that is then not committed (it diverged) must leave the
    state as it was, or its retry steps from the refused weights and momentum."""
    return {
        name: copy.deepcopy(getattr(strategy, name))
        for name in _SERVER_STATE
        if hasattr(strategy, name)
    }


def restore_server_state(strategy: Any, state: Mapping[str, Any]) -> None:
    """Put back what :func:`server_state` copied."""
    for name, value in state.items():
        setattr(strategy, name, value)


def server_tensors(strategy: Any) -> dict[str, np.ndarray]:
    """``strategy``'s state as named tensors for a checkpoint: FedOpt's moments as
    ``m_t/<key>`` and ``v_t/<key>``, FedAvgM's momentum as ``momentum/<key>`` (named by its
    current weights); empty for a rule without such state, or before its first round."""
    tensors: dict[str, np.ndarray] = {}
    for name in _MOMENTS:
        state = getattr(strategy, name, None)
        if isinstance(state, dict):
            tensors |= {f"{name}/{key}": np.asarray(value) for key, value in state.items()}
    momentum = getattr(strategy, "momentum_vector", None)
    current = getattr(strategy, "current_arrays", None)
    if momentum is not None and isinstance(current, ArrayRecord):
        for key, value in zip(current.keys(), momentum, strict=True):
            tensors[f"{_MOMENTUM}/{key}"] = np.asarray(value)
    return tensors


def restore_server_tensors(
    strategy: Any, tensors: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray]
) -> list[str]:
    """Take up what :func:`server_tensors` saved, for a run resumed at ``weights``; return
    what was left out and why (a state this rule does not keep, a tensor the model lacks,
    another shape, not numbers, a non-finite value, a negative second moment). Tensors of the
    model without a saved state start at zero, as a new tensor does after a re-plan."""
    kept: dict[str, dict[str, np.ndarray]] = {}
    dropped: list[str] = []
    for name, value in tensors.items():
        kind, _, key = name.partition("/")
        why = _unfit(strategy, kind, value, weights.get(key))
        if why:
            dropped.append(f"{name}: {why}")
        else:
            kept.setdefault(kind, {})[key] = value
    for kind in _MOMENTS:
        if kind in kept:
            setattr(strategy, kind, _complete(kept[kind], weights))
    if _MOMENTUM in kept:  # FedAvgM steps from the weights its momentum was made on
        strategy.current_arrays = array_record(weights)
        strategy.momentum_vector = list(_complete(kept[_MOMENTUM], weights).values())
    return dropped


def _unfit(strategy: Any, kind: str, value: np.ndarray, target: np.ndarray | None) -> str:
    """Why ``value`` cannot be ``strategy``'s state ``kind`` for the tensor ``target``
    (empty when it can)."""
    attribute = "momentum_vector" if kind == _MOMENTUM else kind
    if kind not in (*_MOMENTS, _MOMENTUM) or not hasattr(strategy, attribute):
        return f"{type(strategy).__name__} keeps no {kind!r} state"
    if target is None:
        return "the model has no such tensor"
    if value.dtype.kind not in "fiu":
        return f"dtype {value.dtype} is not numeric"
    if value.shape != target.shape:
        return f"shape {list(value.shape)}, the tensor's is {list(target.shape)}"
    if not np.isfinite(value).all():
        return "holds non-finite values"
    if kind == "v_t" and (value < 0).any():
        return "a second moment below zero"
    return ""


def _complete(
    state: Mapping[str, np.ndarray], weights: Mapping[str, np.ndarray]
) -> dict[str, np.ndarray]:
    """``state`` for every tensor of ``weights``, in their order (zero where it has none)."""
    return {key: state.get(key, np.zeros_like(value)) for key, value in weights.items()}
