"""The clocks a device times its round with: its training steps (wall and CPU seconds, the
first step and pauses left out) and its uplink."""

from __future__ import annotations

import pytest

from split_models.timing import LinkClock, StepClock

pytestmark = pytest.mark.unit


class Ticks:
    """A clock that advances by the seconds it is told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_step_clock_leaves_the_first_step_out_and_sums_the_rest_per_cut() -> None:
    ticks, cpu = Ticks(), Ticks()
    clock = StepClock(ticks, cpu, share=0.25)
    for seconds, cut, examples in [(5.0, 2, 16), (1.0, 2, 16), (2.0, 3, 8), (1.0, 2, 4)]:
        began = clock.start()
        ticks.now += seconds
        cpu.now += seconds / 2
        clock.add(began, {cut: examples})

    assert clock.metrics() == {
        "compute-seconds": 4.0,
        "compute-steps": 3,
        "compute-cuts": [2, 3],
        "compute-examples": [20, 8],
        "compute-cpu-seconds": 2.0,
        "cpu-share": 0.25,
    }
    clock.reset()
    assert clock.metrics() == {}


def test_steps_on_an_accelerator_report_no_cpu_timing() -> None:
    ticks = Ticks()
    clock = StepClock(ticks, ticks, share=0.5, on_cpu=False)
    for _ in range(2):
        began = clock.start()
        ticks.now += 1.0
        clock.add(began, {2: 8})
    assert clock.metrics() == {
        "compute-seconds": 1.0,
        "compute-steps": 1,
        "compute-cuts": [2],
        "compute-examples": [8],
    }


def test_a_pause_within_a_step_is_left_out_on_both_clocks() -> None:
    ticks, cpu = Ticks(), Ticks()
    clock = StepClock(ticks, cpu)
    for _ in range(2):  # the first step is not counted
        began = clock.start()
        ticks.now += 1.0  # forward
        cpu.now += 1.0
        waiting = clock.start()
        ticks.now += 7.0  # waiting for the gradient
        cpu.now += 0.5  # (the thread polls)
        paused = (waiting, clock.start())
        ticks.now += 2.0  # backward
        cpu.now += 2.0
        clock.add(began, {2: 8}, paused)

    metrics = clock.metrics()
    assert (metrics["compute-seconds"], metrics["compute-cpu-seconds"]) == (3.0, 3.0)


def test_the_link_clock_counts_only_transfers_the_sender_waited_for() -> None:
    ticks = Ticks()
    link = LinkClock(ticks)
    link.published(1000)
    ticks.now = 0.1
    link.acknowledged(0.0005)  # acknowledged before the next step ended: the link kept up
    link.published(2000)
    ticks.now = 0.5
    link.acknowledged(0.05)  # waited: publication to acknowledgement is the transfer
    link.acknowledged(0.05)  # nothing pending

    assert link.metrics() == {"uplink-seconds": pytest.approx(0.4), "uplink-bytes": 2000}
    link.reset()
    assert link.metrics() == {}
