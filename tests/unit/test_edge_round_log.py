"""The edge's line for a round: a measured peak over the budget is a warning (the estimate fell
short on this device), and a backprop round, which has no local loss, does not read 'loss nan'."""

from __future__ import annotations

import logging

import pytest

from edge_client.agent import EdgeAgent
from edge_client.trainer import EdgeRoundReport

pytestmark = pytest.mark.unit
MIB = 1 << 20


def _agent(budget: int) -> EdgeAgent:
    agent = EdgeAgent.__new__(EdgeAgent)  # only the budget is read
    agent.budget = budget
    return agent


def _report(loss: float) -> EdgeRoundReport:
    return EdgeRoundReport(
        examples=64,
        batches=2,
        mean_loss=loss,
        bytes_sent=0,
        credit_wait_seconds=0.0,
        wall_seconds=1.0,
    )


def test_a_peak_over_the_budget_is_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="edge_client.agent"):
        _agent(10 * MIB).log_round(1, _report(0.5), 13 * MIB, 9 * MIB)
        _agent(10 * MIB).log_round(2, _report(0.5), 9 * MIB, 9 * MIB)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "round 1" in warnings[0], warnings
    assert "13.0 MiB went over the budget 10.0 MiB (estimated 9.0 MiB)" in warnings[0]


def test_a_round_without_a_local_loss_says_so(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="edge_client.agent"):
        _agent(10 * MIB).log_round(1, _report(float("nan")), -1, 9 * MIB)
        _agent(10 * MIB).log_round(2, _report(0.25), -1, 9 * MIB)
    lines = [r.getMessage() for r in caplog.records]
    assert "no local loss" in lines[0] and "nan" not in lines[0], lines
    assert "loss 0.2500" in lines[1] and "peak not measured" in lines[1], lines
