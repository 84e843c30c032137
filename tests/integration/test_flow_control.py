"""Credit-based flow control holds a fast producer to the server's window, on both transports."""

from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid

import numpy as np
import pytest

from wire import topics
from wire.broker import Broker
from wire.channel import Channel
from wire.codec import Envelope
from wire.flow import CreditGate, CreditGranter
from wire.mqtt import MqttConfig, MqttTransport
from wire.transport import InProcessHub, Transport

WINDOW, BATCHES = 3, 30


def _run_stream(edge_transport: Transport, server_transport: Transport) -> tuple[int, int]:
    run = f"flow-{uuid.uuid4().hex[:6]}"
    edge, server = Channel(edge_transport, "pi-01"), Channel(server_transport, "gpu-a")
    in_flight, peak, done = [0], [0], threading.Event()
    lock = threading.Lock()
    granter = CreditGranter(server, run, window=WINDOW)

    def consume(envelope: Envelope) -> None:  # a slow GPU server
        time.sleep(0.01)
        with lock:
            in_flight[0] -= 1
        granter.processed(envelope.sender)
        if envelope.seq == BATCHES - 1:
            done.set()

    server.subscribe(topics.activations(run, "seg", "pi-01"), consume)
    gate = CreditGate(edge, run, "pi-01")
    time.sleep(0.3)
    granter.open("pi-01")
    for _ in range(BATCHES):  # a producer that would send everything at once
        assert gate.acquire(timeout=10), "credits stopped arriving"
        with lock:
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
        edge.send(
            topics.activations(run, "seg", "pi-01"),
            "activations",
            run,
            tensors={"x": np.ones((4, 8), dtype=np.float32)},
        )
    assert done.wait(30)
    return peak[0], server.stats.received


@pytest.mark.unit
def test_credits_hold_a_fast_producer_in_process() -> None:
    hub = InProcessHub()
    peak, received = _run_stream(hub.connect("edge"), hub.connect("gpu"))
    assert peak <= WINDOW and received == BATCHES


@pytest.mark.integration
def test_credits_hold_a_fast_producer_over_mqtt(broker: Broker) -> None:
    config = MqttConfig.from_url(broker.url)
    edge, gpu = MqttTransport(config, "edge-flow"), MqttTransport(config, "gpu-flow")
    try:
        peak, received = _run_stream(edge, gpu)
    finally:
        edge.close()
        gpu.close()
    assert peak <= WINDOW and received == BATCHES


@pytest.mark.unit
def test_acquire_times_out_with_an_injected_clock() -> None:
    hub = InProcessHub()
    ticks = itertools.count()  # every reading of the clock is one second later
    gate = CreditGate(Channel(hub.connect("e"), "e"), "r", "e", clock=lambda: float(next(ticks)))
    started = time.monotonic()
    assert gate.acquire(timeout=3) is False
    assert time.monotonic() - started < 2, "the injected clock, not wall time, ends the wait"
    gate.grant(1)
    assert gate.acquire(timeout=0) is True and gate.available == 0


@pytest.mark.unit
def test_a_long_wait_for_credits_is_said_once(caplog: pytest.LogCaptureFixture) -> None:
    """A frozen GPU server held its edges 30 s with nothing in any log (an operator's trial)."""
    hub = InProcessHub()
    ticks = itertools.count()  # one second a reading
    gate = CreditGate(
        Channel(hub.connect("e"), "e"), "r", "pi-01", clock=lambda: float(next(ticks))
    )
    gate.start_round(3, 2)
    with caplog.at_level(logging.INFO, logger="wire.flow"):
        assert gate.acquire(timeout=30) is False
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and said[0].startswith("pi-01: no credit from the GPU servers for 1"), (
        said
    )
    assert "in round 3 (try 2)" in said[0]
