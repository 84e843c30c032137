"""A device's speed measured at start (``edgesplit edge --flops auto``)."""

from __future__ import annotations

import math
import time

import pytest
import torch

from split_models.calibration import measure_flops
from split_models.flops import count_flops
from split_models.segment import Segment, StepResult
from split_models.zoo import build_model

pytestmark = pytest.mark.unit


def test_the_measured_speed_follows_how_long_the_steps_take(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fast = measure_flops(seconds=0.2)
    step = Segment.train_step

    def slow(self: Segment, inputs: object, labels: object) -> StepResult:
        time.sleep(0.2)
        return step(self, inputs, labels)  # type: ignore[arg-type]

    monkeypatch.setattr(Segment, "train_step", slow)
    slowed = measure_flops(seconds=0.2)

    model = build_model("cnn", (1, 28, 28), 10, seed=0)
    per_sample = count_flops(model.segment(0, model.num_blocks), torch.rand(32, 1, 28, 28), 32)
    assert math.isfinite(fast) and fast > 1e8
    # each step takes 0.2 s more: at most 3 x 32 x the cnn's FLOPs per sample in 0.2 s
    assert slowed <= 3 * 32 * per_sample / 0.2, (fast, slowed)
