"""An edge that stays online and answers nothing is benched for a while, not waited for to
the deadline every round (a hostile-device trial held every round 40 s that way)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from coordinator.bench import Bench
from coordinator.recorder import Outcome
from coordinator.replies import NO_REPLY
from storage.records import DeviceResult

pytestmark = pytest.mark.unit

NODES = {"pi-01": 1, "pi-02": 2, "pi-03": 3}
SENT = {name: SimpleNamespace(metadata=SimpleNamespace(dst_node_id=n)) for name, n in NODES.items()}


def _outcome(**failures: str) -> Outcome:
    results = [DeviceResult(d, failure=failures.get(d)) for d in NODES]
    silent = [d for d, why in failures.items() if why in (NO_REPLY, "offline")]
    return Outcome(results, [d for d in NODES if d not in failures], silent=silent)


def test_an_edge_silent_twice_is_benched_for_longer_each_time() -> None:
    bench, events = Bench(), []

    def event(number: int, kind: str, detail: str, device: str) -> None:
        events.append((number, kind, device, detail))

    everyone = sorted(NODES.values())
    bench.after(1, _outcome(**{"pi-03": NO_REPLY}), SENT, event)  # type: ignore[arg-type]
    assert bench.choose(2, everyone, 1) == everyone and events == []
    bench.after(2, _outcome(**{"pi-03": NO_REPLY}), SENT, event)  # type: ignore[arg-type]
    assert events[0][:3] == (2, "device-benched", "pi-03")
    assert "not waited for in the next 1 round(s); asked again from round 4" in events[0][3]
    assert bench.choose(3, everyone, 1) == [1, 2]
    assert bench.choose(3, everyone, 3) == everyone, "never fewer than the round needs"
    assert bench.choose(4, everyone, 1) == everyone, "asked again"
    for number in (4, 5):
        bench.after(number, _outcome(**{"pi-03": NO_REPLY}), SENT, event)  # type: ignore[arg-type]
    assert "next 2 round(s); asked again from round 8" in events[1][3]
    assert bench.choose(7, everyone, 1) == [1, 2] and bench.choose(8, everyone, 1) == everyone
    # a reply (an error it names counts) ends the strikes and the doubling
    bench.after(8, _outcome(**{"pi-03": "refused: busy"}), SENT, event)  # type: ignore[arg-type]
    for number in (9, 10):
        bench.after(number, _outcome(**{"pi-03": NO_REPLY}), SENT, event)  # type: ignore[arg-type]
    assert "next 1 round(s)" in events[2][3]


def test_an_offline_edge_is_not_benched() -> None:
    bench, events = Bench(), []
    offline = _outcome(**{"pi-02": "offline"})
    for number in (1, 2, 3):
        bench.after(number, offline, SENT, lambda *said: events.append(said))  # type: ignore[arg-type]
    assert events == [] and bench.choose(4, [1, 2, 3], 1) == [1, 2, 3]


def test_a_gpu_server_is_no_edge_to_bench() -> None:
    bench, events = Bench(), []
    late = _outcome(**{"pi-01": NO_REPLY})
    for number in (1, 2):
        bench.after(number, late, SENT, lambda *said: events.append(said), servers=["pi-01"])  # type: ignore[arg-type]
    assert events == [] and bench.choose(3, [1, 2, 3], 1) == [1, 2, 3]
