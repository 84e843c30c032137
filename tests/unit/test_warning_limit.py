"""A flood of bad messages does not flood the log: warnings are limited per key."""

from __future__ import annotations

import logging
import time
import uuid

import pytest

from wire.logs import WarningLimiter

pytestmark = pytest.mark.unit


def test_a_key_logs_a_burst_per_window_then_says_how_many_it_left_out() -> None:
    now = [0.0]
    limiter = WarningLimiter(burst=3, window=10.0, clock=lambda: now[0])
    assert [limiter.admit("mallory")[0] for _ in range(5)] == [True, True, True, False, False]
    assert limiter.admit("pi-01") == (True, 0)  # another key has its own burst
    now[0] = 10.5
    assert limiter.admit("mallory") == (True, 2)  # the two left out are told once
    assert limiter.admit("mallory") == (True, 0)


def test_a_flood_of_rejected_messages_logs_a_few_lines(caplog: pytest.LogCaptureFixture) -> None:
    import numpy as np

    from wire import topics
    from wire.channel import Channel
    from wire.transport import InProcessHub

    run = f"r{uuid.uuid4().hex[:8]}"  # the limiter is per process: a key of this test only
    hub = InProcessHub()
    receiver = Channel(hub.connect("gpu"), "gpu-a")
    receiver.subscribe(topics.activations_filter(run, "s"), lambda _e: None)
    flooder = hub.connect("mallory")
    with caplog.at_level(logging.WARNING, logger="wire.channel"):
        for _ in range(500):
            flooder.publish(topics.activations(run, "s", "mallory"), b"junk")
        Channel(hub.connect("x"), "x").send(
            topics.activations(run, "s", "x"), "activations", run, tensors={"x": np.ones(2)}
        )  # a valid one still goes through
        deadline = time.monotonic() + 10
        while sum(receiver.stats.rejected.values()) < 500 and time.monotonic() < deadline:
            time.sleep(0.02)
    rejected = [r for r in caplog.records if "rejected message" in r.getMessage()]
    assert receiver.stats.rejected and sum(receiver.stats.rejected.values()) == 500
    assert 1 <= len(rejected) <= 5
