"""``RoundLedger.settle`` checks only the senders whose declaration or counts changed since it
last ran; it must finish exactly the senders a full recount would."""

from __future__ import annotations

import collections

from hypothesis import given, settings
from hypothesis import strategies as st

from wire.agreement import RoundLedger

SENDERS = ["a", "b", "c", "d"]
PEERS = ["p1", "p2"]

_op = st.one_of(
    st.tuples(st.just("declare"), st.sampled_from([*SENDERS, "stranger"]), st.integers(0, 4)),
    st.tuples(st.just("handled"), st.sampled_from([*SENDERS, "stranger"]), st.just(0)),
    st.tuples(
        st.just("peer"),
        st.sampled_from([*PEERS, "outsider"]),
        st.dictionaries(st.sampled_from(SENDERS), st.integers(0, 4), max_size=4),
    ),
    st.tuples(st.just("leave"), st.sampled_from(SENDERS), st.just(0)),
    st.tuples(st.just("settle"), st.just(""), st.just(0)),
)


def _recount(ledger: RoundLedger, finished: set[str]) -> set[str]:
    """The finished senders by brute force: every declared sender whose counts add up."""
    return finished | {
        sender
        for sender, batches in ledger.declared.items()
        if sum(c[sender] for c in ledger.counts.values()) >= batches
    }


@settings(max_examples=300, deadline=None)
@given(st.lists(_op, max_size=40))
def test_settling_the_changed_senders_finishes_what_a_full_recount_does(ops: list) -> None:
    ledger = RoundLedger(1, SENDERS, "me", PEERS)
    expected: set[str] = set()
    for kind, who, value in [*ops, ("settle", "", 0)]:
        if kind == "declare":
            ledger.declare(who, value)
        elif kind == "handled":
            ledger.handled(who)
        elif kind == "peer":
            ledger.peer_counts(who, collections.Counter(value))
        elif kind == "leave":
            ledger.leave(who)
        else:
            new = ledger.settle()
            assert not new & expected, "a sender finished twice"
            expected = _recount(ledger, expected)
            assert ledger.finished == expected
            assert new <= expected
