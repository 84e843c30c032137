"""The values a strategy's options may take, checked when a run's config is read.

Flower's strategies take their options as they come: a negative server step, a momentum of
1.5, a learning rate of ``true`` (read as 1) or ``"x"`` (a ``TypeError`` at the first
aggregation) all construct. A run then diverges, or learns nothing, or fails rounds into
training. Each option edgesplit passes on has its range here, so a bad value stops the run
before it starts, named with the range it must lie in.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from split_models.errors import ConfigError

__all__ = ["check_options", "option_names"]

_INF = math.inf
# option -> (low, high, low allowed, high allowed, whole numbers only)
_RANGES: dict[str, tuple[float, float, bool, bool, bool]] = {
    "fraction_train": (0, 1, False, True, False),
    "fraction_evaluate": (0, 1, True, True, False),
    "min_train_nodes": (1, _INF, True, False, True),
    "min_evaluate_nodes": (0, _INF, True, False, True),
    "min_available_nodes": (0, _INF, True, False, True),
    "proximal_mu": (0, 1e6, True, True, False),  # FedProx; what the devices accept
    "eta": (0, _INF, False, False, False),  # FedOpt's server step
    "eta_l": (0, _INF, False, False, False),
    "beta_1": (0, 1, True, False, False),
    "beta_2": (0, 1, True, False, False),
    "tau": (0, _INF, False, False, False),  # FedOpt's denominator: above zero
    "server_learning_rate": (0, _INF, False, False, False),  # FedAvgM
    "server_momentum": (0, 1, True, False, False),
    "beta": (0, 0.5, True, False, False),  # FedTrimmedAvg: the share cut from each end
    "num_malicious_nodes": (0, _INF, True, False, True),  # Krum, MultiKrum, Bulyan
    "num_nodes_to_select": (1, _INF, True, False, True),  # MultiKrum
}
# Flower's plumbing, which edgesplit sets itself or which a config file cannot express
_INTERNAL = frozenset(
    {
        "weighted_by_key",
        "arrayrecord_key",
        "configrecord_key",
        "train_metrics_aggr_fn",
        "evaluate_metrics_aggr_fn",
        "selection_rule",
    }
)


def check_options(name: str, options: Mapping[str, Any]) -> None:
    """Raise :class:`ConfigError` for the first option of strategy ``name`` whose value is out
    of its range (or of a kind it cannot be); options without a range here are left to the
    strategy's constructor."""
    for option, value in options.items():
        if "-" in option:  # Flower's message key (proximal-mu) for its argument (proximal_mu)
            raise ConfigError(
                f"strategy {name!r}: {option}: write it {option.replace('-', '_')} (the "
                "strategy's argument; edgesplit sends it to the devices under Flower's key)"
            )
        if option in _INTERNAL:
            raise ConfigError(
                f"strategy {name!r}: {option}: set by edgesplit itself, not by the config"
            )
        if option in _RANGES:
            why = _out_of_range(value, *_RANGES[option])
            if why:
                raise ConfigError(f"strategy {name!r}: {option}: {why}, got {value!r}")


def _out_of_range(
    value: object, low: float, high: float, low_in: bool, high_in: bool, whole: bool
) -> str:
    """Why ``value`` is not in the interval (empty when it is)."""
    interval = f"{'[' if low_in else '('}{low:g}, {high:g}{']' if high_in else ')'}"
    kind = "a whole number" if whole else "a number"
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        return f"expected {kind} in {interval}"
    if whole and (not math.isfinite(value) or value != int(value)):
        return f"expected {kind} in {interval}"
    above = value > low or (low_in and value == low)
    below = value < high or (high_in and value == high)
    return "" if above and below else f"expected {kind} in {interval}"


def option_names() -> frozenset[str]:
    """The strategy options whose ranges are known here (a config names its section when one
    is written outside ``strategy``)."""
    return frozenset(_RANGES)
