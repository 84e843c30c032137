"""When a round's replies are enough to commit: every piece of the back that was sent work,
and ``min_train_nodes`` edges."""

from __future__ import annotations

import pytest

from coordinator.recorder import Outcome
from coordinator.runner import shortfall
from storage.records import DeviceResult

pytestmark = pytest.mark.unit


def _outcome(ok: list[str], failed: dict[str, str]) -> Outcome:
    results = [DeviceResult(d, examples=1) for d in ok]
    results += [DeviceResult(d, failure=why) for d, why in failed.items()]
    return Outcome(results, ok)


def test_every_piece_and_enough_edges_commit() -> None:
    servers = {"g1": (1, 3), "g2": (3, 5)}
    outcome = _outcome(["e1", "g1", "g2"], {"e2": "offline"})
    assert shortfall(["e1", "e2", "g1", "g2"], servers, True, outcome, 1) is None


def test_a_missing_piece_names_the_failures() -> None:
    servers = {"g1": (1, 3), "g2": (3, 5)}
    outcome = _outcome(["e1", "g1"], {"g2": "no reply before the deadline"})
    why = shortfall(["e1", "g1", "g2"], servers, True, outcome, 1)
    assert why == "g2: no reply before the deadline"


def test_replicas_of_one_piece_need_only_one_answer() -> None:
    servers = {"g1": (1, 5), "g2": (1, 5)}
    outcome = _outcome(["e1", "g1"], {"g2": "offline"})
    assert shortfall(["e1", "g1", "g2"], servers, True, outcome, 1) is None


def test_too_few_edges_or_no_server_at_all_do_not_commit() -> None:
    outcome = _outcome(["e1", "g1"], {"e2": "offline"})
    assert shortfall(["e1", "e2", "g1"], {"g1": (1, 5)}, True, outcome, 2) == "e2: offline"
    alone = _outcome(["e1"], {})
    assert shortfall(["e1"], {}, True, alone, 1) == "not enough replies"
    assert shortfall(["e1"], {}, False, alone, 1) is None  # whole-model rounds have no servers
