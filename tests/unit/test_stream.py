"""The server side of a stream: the end-of-round agreement by counts, and rejections that
cost one batch each, once, without letting a bad message move any other state."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
import pytest

from wire import topics
from wire.agreement import RoundLedger
from wire.channel import Channel
from wire.codec import Envelope, encode
from wire.errors import WireError
from wire.flow import CreditGate
from wire.stream import StreamServer
from wire.transport import InProcessHub

pytestmark = pytest.mark.unit

RUN, EDGE = "r1", "pi-01"


def test_a_sender_finishes_when_the_servers_counts_add_up() -> None:
    ledger = RoundLedger(3, ["pi-01", "pi-02"], "gpu-a", peers=["gpu-a", "gpu-b"])
    assert ledger.peers == {"gpu-b"}
    assert not ledger.declare("pi-99", 1), "only the round's senders count"
    ledger.declare("pi-01", 3)
    ledger.handled("pi-01")
    assert ledger.settle() == set()
    ledger.peer_counts("gpu-b", {"pi-01": 2})
    assert ledger.settle() == {"pi-01"} and not ledger.complete
    ledger.declare("pi-02", 0)
    assert ledger.settle() == {"pi-02"} and ledger.complete
    assert RoundLedger(1, [], "gpu-a").complete, "a round without senders is over at once"


def _until(condition: Callable[[], bool], timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def _raw(seq: int, round_number: int, x: np.ndarray, sender: str = EDGE) -> bytes:
    return encode(
        Envelope("activations", RUN, sender, seq, round_number, {"epoch": "e1", "cut": 1}, {"x": x})
    )


def _server() -> tuple[StreamServer, CreditGate, list[Envelope], InProcessHub]:
    hub = InProcessHub()
    handled: list[Envelope] = []

    def handle(envelope: Envelope) -> None:
        if envelope.tensors["x"].shape[1] != 4:
            raise WireError("shape", "x must have 4 features")
        handled.append(envelope)

    server = StreamServer(Channel(hub.connect("gpu"), "gpu-a"), RUN, "seg-0", handle, window=2)
    edge = Channel(hub.connect(EDGE), EDGE)
    gate = CreditGate(edge, RUN, EDGE)
    gate.start_round(1)
    server.begin_round(1, [EDGE])
    assert _until(lambda: gate.available == 2)
    return server, gate, handled, hub


def test_a_rejected_batch_returns_its_credit_and_counts_once() -> None:
    server, gate, handled, hub = _server()
    raw = hub.connect("raw")
    topic = topics.activations(RUN, "seg-0", EDGE)
    nan = np.full((2, 4), np.nan, np.float32)
    for _ in range(2):  # a redelivery of the same rejected batch
        raw.publish(topic, _raw(0, 1, nan))
    raw.publish(topic, _raw(1, 1, np.ones((2, 5), np.float32)))  # the handler rejects it
    raw.publish(topic, _raw(2, 1, np.ones((2, 4), np.float32)))
    Channel(hub.connect("done"), EDGE).send(
        topics.done(RUN, EDGE), "round_control", RUN, round=1, meta={"batches": 3}
    )

    assert server.wait_round(5.0), "three batches sent, three handled (two rejected)"
    assert [e.seq for e in handled] == [2]
    assert server.stats.rejected["non_finite"] == 2 and server.stats.rejected["shape"] == 1
    assert server.stats.handled[EDGE] == 3, "the redelivered rejection counted once"
    assert _until(lambda: gate.available == 5) and not _until(lambda: gate.available > 5, 0.3)


def test_a_rejection_cannot_move_other_state() -> None:
    server, gate, _handled, hub = _server()
    raw = hub.connect("raw")
    topic = topics.activations(RUN, "seg-0", EDGE)
    nan = np.full((2, 4), np.nan, np.float32)
    raw.publish(topic, _raw(0, 10**9, nan))  # a round far ahead: parked, nothing else
    raw.publish(topic, _raw(5, 1, np.ones((2, 4), np.float32), sender="pi-02"))  # not its topic
    raw.publish(topic, b"ESW1" + b"\xff" * 20)  # no header to attribute it by
    assert _until(lambda: sum(server.stats.rejected.values()) == 3)

    assert server.round_number == 1 and server.finished == set()
    assert server.stats.rejected["sender"] == 1, "the topic names the sender, not the header"
    assert server.stats.handled[EDGE] == 1 and "pi-02" not in server.stats.handled
    assert _until(lambda: gate.available == 3), "only the attributable batch of round 1"


def test_a_redelivered_rejection_parked_for_a_later_round_counts_once() -> None:
    server, gate, handled, hub = _server()
    raw = hub.connect("raw")
    topic = topics.activations(RUN, "seg-0", EDGE)
    nan = np.full((2, 4), np.nan, np.float32)
    raw.publish(topic, _raw(0, 2, nan))  # round 2 not begun here yet: parked as rejected
    assert _until(lambda: server.stats.rejected["non_finite"] == 1)
    gate.start_round(2)
    server.begin_round(2, [EDGE])
    raw.publish(topic, _raw(0, 2, nan))  # the broker redelivers it after the round began
    raw.publish(topic, _raw(1, 2, np.ones((2, 4), np.float32)))
    assert _until(lambda: len(handled) == 1 and server.stats.rejected["non_finite"] == 2)
    Channel(hub.connect("done"), EDGE).send(
        topics.done(RUN, EDGE), "round_control", RUN, round=2, meta={"batches": 3}
    )
    assert not server.wait_round(0.5), "two batches handled of three: the copy counted once"
    assert server.stats.handled[EDGE] == 2


def test_a_rejection_parked_for_a_later_round_is_told_to_its_sender_when_it_begins() -> None:
    server, gate, _handled, hub = _server()
    refused: list[tuple[str, int, int, str]] = []
    server.on_refused = lambda *refusal: refused.append(refusal)
    raw = hub.connect("raw")
    topic = topics.activations(RUN, "seg-0", EDGE)
    raw.publish(topic, _raw(7, 2, np.full((2, 4), np.nan, np.float32)))  # round 2: parked
    assert _until(lambda: server.stats.rejected["non_finite"] == 1)
    assert refused == [], "not told before the round it belongs to"
    gate.start_round(2)
    server.begin_round(2, [EDGE])
    assert len(refused) == 1 and refused[0][:3] == (EDGE, 2, 7), refused
    assert "finite" in refused[0][3], "the sender hears why"


def test_a_sender_is_told_of_a_check_but_not_of_the_servers_own_failure() -> None:
    hub = InProcessHub()

    def handle(envelope: Envelope) -> None:
        if envelope.seq == 0:
            raise WireError("shape", "x must have 4 features")
        raise RuntimeError("cannot open /srv/secret/state.bin")

    server = StreamServer(Channel(hub.connect("gpu"), "gpu-a"), RUN, "seg-0", handle)
    refused: list[tuple[str, int, int, str]] = []
    server.on_refused = lambda *refusal: refused.append(refusal)
    server.begin_round(1, [EDGE])
    raw = hub.connect("raw")
    for seq in (0, 1):
        raw.publish(topics.activations(RUN, "seg-0", EDGE), _raw(seq, 1, np.ones((2, 4))))
    assert _until(lambda: len(refused) == 2), refused
    assert "4 features" in refused[0][3], "a check's reason is the sender's to know"
    assert "secret" not in refused[1][3] and "server's log" in refused[1][3]
    assert server.stats.rejected["error"] == 1


def test_a_batch_from_a_device_not_sending_in_the_round_is_not_trained() -> None:
    server, _gate, handled, hub = _server()
    stranger = "pi-09"
    raw = hub.connect(stranger)
    topic = topics.activations(RUN, "seg-0", stranger)
    raw.publish(topic, _raw(0, 1, np.ones((2, 4), np.float32), sender=stranger))
    raw.publish(topic, _raw(1, 1, np.full((2, 4), np.nan, np.float32), sender=stranger))
    assert _until(lambda: server.stats.rejected["sender"] == 2)
    assert handled == [] and server.stats.rejected["non_finite"] == 0
    assert stranger not in server.stats.handled and server.finished == set()
    Channel(hub.connect("done"), EDGE).send(
        topics.done(RUN, EDGE), "round_control", RUN, round=1, meta={"batches": 0}
    )
    assert server.wait_round(5.0) and server.finished == {EDGE}, "the ledger did not move"


def test_an_ordered_stream_hands_batches_on_sender_by_sender_in_name_order() -> None:
    hub = InProcessHub()
    handled: list[tuple[str, int]] = []
    server = StreamServer(
        Channel(hub.connect("gpu"), "gpu-a"),
        RUN,
        "seg-0",
        lambda e: handled.append((e.sender, e.seq)),
        window=2,
        ordered=True,
    )
    senders = ["pi-02", "pi-01", "pi-03"]
    gates = {}
    for name in senders:
        gates[name] = CreditGate(Channel(hub.connect(name), name), RUN, name)
        gates[name].start_round(1)
    server.begin_round(1, senders)
    raw = hub.connect("raw")
    ones = np.ones((2, 4), np.float32)

    def send(name: str, seq: int, x: np.ndarray = ones) -> None:
        raw.publish(topics.activations(RUN, "seg-0", name), _raw(seq, 1, x, sender=name))

    def done(name: str, batches: int) -> None:
        Channel(hub.connect(f"done-{name}"), name).send(
            topics.done(RUN, name), "round_control", RUN, round=1, meta={"batches": batches}
        )

    send("pi-03", 0)  # the last in turn comes first: it waits, its credit with it
    send("pi-02", 0)
    send("pi-02", 1)
    assert handled == [] and _until(lambda: gates["pi-03"].available == 2)
    assert not _until(lambda: gates["pi-03"].available > 2, 0.2), "no credit while waiting"
    send("pi-03", 1)
    send("pi-03", 2)  # beyond its two credits: a sender ignoring them is not buffered
    assert _until(lambda: server.stats.rejected["over_window"] == 1)
    send("pi-01", 0)
    send("pi-01", 1, np.full((2, 4), np.nan, np.float32))  # rejected: still takes its turn
    assert _until(lambda: server.stats.rejected["non_finite"] == 1)
    assert handled == [("pi-01", 0)], "pi-01 is not finished until it says what it sent"
    done("pi-01", 2)
    assert _until(lambda: len(handled) == 3)
    assert handled == [("pi-01", 0), ("pi-02", 0), ("pi-02", 1)]
    done("pi-02", 2)
    assert _until(lambda: len(handled) == 5) and handled[-2:] == [("pi-03", 0), ("pi-03", 1)]
    assert _until(lambda: gates["pi-03"].available == 4)
    done("pi-03", 2)
    assert server.wait_round(5.0) and server.stats.rejected["non_finite"] == 1


def test_a_done_said_before_a_round_began_counts_only_for_its_own_try() -> None:
    # an edge that gave try 1 of round 2 up before this server began it says 'done' with
    # the batches it sent (none); the server then begins try 2, which must wait for the
    # edge's batches of try 2, not finish at once on try 1's count
    server, gate, handled, hub = _server()
    done = Channel(hub.connect("done"), EDGE)

    def say_done(attempt: int, batches: int) -> None:
        meta = {"batches": batches, "attempt": attempt}
        done.send(topics.done(RUN, EDGE), "round_control", RUN, round=2, meta=meta)

    say_done(1, 0)
    time.sleep(0.2)  # delivered, remembered for round 2
    gate.start_round(2, attempt=2)
    server.begin_round(2, [EDGE], attempt=2)
    assert not server.wait_round(0.3), "try 1's count does not end try 2"
    meta = {"epoch": "e1", "cut": 1, "attempt": 2}
    batch = Envelope("activations", RUN, EDGE, 0, 2, meta, {"x": np.ones((2, 4), np.float32)})
    hub.connect("raw").publish(topics.activations(RUN, "seg-0", EDGE), encode(batch))
    say_done(2, 1)
    assert server.wait_round(5.0) and len(handled) == 1, "try 2 ends on its own count"


def test_a_retried_rounds_credits_are_kept_apart_from_the_first_attempts() -> None:
    hub = InProcessHub()
    gate = CreditGate(Channel(hub.connect(EDGE), EDGE), RUN, EDGE, subscribe=False)

    def credit(number: int, attempt: int, credits: int = 2) -> None:
        meta = {"credits": credits, "attempt": attempt}
        gate.on_credit(Envelope("credit", RUN, "gpu-a", 0, number, meta, {}))

    gate.start_round(1)
    credit(1, 1)
    assert gate.available == 2
    credit(1, 2)  # the retry's window, before this edge heard of the retry
    credit(1, 1, 1)  # a late credit of the first attempt
    assert gate.available == 3
    gate.start_round(1, attempt=2)
    assert gate.available == 2, "the retry starts with its own window only"
    credit(1, 1, 1)
    credit(1, 0, 5)  # not an attempt: ignored
    assert gate.available == 2


def test_a_round_redone_after_a_rewind_takes_the_window_that_came_before_it_began() -> None:
    """A coordinator resumed from an earlier checkpoint (a later one was corrupt) redoes a
    round this edge has passed; its server's window came before the edge began the round and
    was dropped as a past round's, so every edge waited for credits until the deadline."""
    hub = InProcessHub()
    gate = CreditGate(Channel(hub.connect(EDGE), EDGE), RUN, EDGE, subscribe=False)

    def credit(number: int, attempt: int, credits: int = 4) -> None:
        meta = {"credits": credits, "attempt": attempt}
        gate.on_credit(Envelope("credit", RUN, "gpu-a", 0, number, meta, {}))

    gate.start_round(3)  # the round the run was at when it stopped
    credit(2, 3)  # round 2 again, try 3: the server's window comes first
    gate.start_round(2, attempt=3)
    assert gate.available == 4


def test_one_device_cannot_fill_what_the_server_keeps_for_rounds_not_begun() -> None:
    """Batches, rejections and done counts for far rounds are bounded per sender: mallory's
    flood leaves room for pi-01's batch and done count that arrive before round 2 begins."""
    server, gate, handled, hub = _server()
    mallory = hub.connect("mallory")
    junk = np.ones((2, 4), np.float32)
    for seq in range(200):
        mallory.publish(
            topics.activations(RUN, "seg-0", "mallory"), _raw(seq, 10**6 + seq, junk, "mallory")
        )
        mallory.publish(
            topics.activations(RUN, "seg-0", "mallory"),
            _raw(10_000 + seq, 10**6 + seq, np.full((2, 4), np.nan, np.float32), "mallory"),
        )
        Channel(mallory, "mallory").send(
            topics.done(RUN, "mallory"),
            "round_control",
            RUN,
            round=10**6 + seq,
            meta={"batches": 1},
        )
    raw = hub.connect("raw")
    raw.publish(topics.activations(RUN, "seg-0", EDGE), _raw(0, 2, junk))  # before round 2
    Channel(hub.connect("done"), EDGE).send(
        topics.done(RUN, EDGE), "round_control", RUN, round=2, meta={"batches": 1}
    )
    time.sleep(0.3)
    gate.start_round(2)
    server.begin_round(2, [EDGE])
    assert server.wait_round(5.0), "pi-01's parked batch and done count were kept"
    assert [e.sender for e in handled] == [EDGE]


def test_a_server_between_rounds_takes_no_share_of_the_stream() -> None:
    # two servers share a stream; one parts after its round: every batch goes to the other,
    # until the parted one begins a round again
    server, _gate, handled, hub = _server()
    other: list[Envelope] = []
    peer = StreamServer(Channel(hub.connect("gpu-b"), "gpu-b"), RUN, "seg-0", other.append)
    peer.begin_round(1, [EDGE])
    raw = hub.connect("raw")
    topic = topics.activations(RUN, "seg-0", EDGE)
    server.part()

    for seq in range(6):
        raw.publish(topic, _raw(seq, 1, np.ones((2, 4), np.float32)))

    assert _until(lambda: len(other) == 6), "the parted server took a share"
    assert handled == []
    server.begin_round(2, [EDGE])  # joins the stream again before its credits
    for seq in range(6, 40):
        raw.publish(topic, _raw(seq, 2, np.ones((2, 4), np.float32)))
    assert _until(lambda: len(handled) > 0), "back in the stream, it takes its share"


def test_a_chain_piece_passes_batches_on_once_the_next_piece_began_the_round() -> None:
    from gpu_server.chain import ChainLink

    hub = InProcessHub()
    link = ChainLink(Channel(hub.connect("gpu-a"), "gpu-a"), RUN, "seg-1", cut=3)
    assert not link.await_next(1, 1, timeout=0.2), "nobody serves the next piece yet"
    passed: list[Envelope] = []
    nxt = StreamServer(Channel(hub.connect("gpu-b"), "gpu-b"), RUN, "seg-1", passed.append)
    nxt.begin_round(1, ["gpu-a"])

    assert link.await_next(1, 1, timeout=5.0), "the next piece's first credit"
    link.pass_on({"x": np.ones((2, 4), np.float32)}, np.zeros(2, np.int64), 1)
    assert _until(lambda: len(passed) == 1)
    assert not link.await_next(1, 2, timeout=0.2), "a retry waits for the retry's credits"
