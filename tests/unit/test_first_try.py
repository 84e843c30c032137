"""A restarted coordinator numbers the tries of the round it resumes above every try an
earlier coordinator gave that round (devices tell a round's tries apart by number)."""

from __future__ import annotations

from coordinator.resumption import first_try
from storage import open_store
from storage.records import Event


def test_a_round_no_coordinator_opened_starts_at_try_1() -> None:
    with open_store("memory://") as store:
        store.create_run("r", {"model": "cnn"}, seed=0)
        store.add_event("r", Event("resumed", "after round 0 (created)"))
        assert first_try(store, "r", 1) == 1


def test_a_resumed_round_is_tried_above_its_earlier_tries() -> None:
    with open_store("memory://") as store:
        store.create_run("r", {"model": "cnn"}, seed=0)
        store.open_round("r", 1, ["pi-01"])
        # the first coordinator's try 1 was cut short by its end: one resumed event
        store.add_event("r", Event("resumed", "after round 0 (training)"))
        assert first_try(store, "r", 1) == 2
        # the second one's tries 2 and 3 failed, try 4 was cut short
        for _ in range(2):
            store.add_event("r", Event("round-failed", "no reply", round=1))
        store.add_event("r", Event("resumed", "after round 0 (training)"))
        assert first_try(store, "r", 1) == 5
        assert first_try(store, "r", 2) == 1, "a later round starts afresh"
