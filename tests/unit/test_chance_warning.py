"""``edgesplit simulate`` says so when a run ends no better than guessing (a user-style trial's
diverged baselines finished with exit 0 and only the last line's number to tell)."""

from __future__ import annotations

import pytest

from simulation.command import _say_if_at_chance

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("accuracy", "classes", "warned"),
    [(0.095, 10, True), (0.149, 10, True), (0.16, 10, False), (0.7, 2, False), (0.52, 2, True)],
)
def test_an_accuracy_at_chance_is_a_warning(
    accuracy: float, classes: int, warned: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    _say_if_at_chance(accuracy, classes)
    assert ("at chance level" in capsys.readouterr().out) is warned


def test_no_evaluated_round_is_no_warning(capsys: pytest.CaptureFixture[str]) -> None:
    _say_if_at_chance(None, 10)
    assert capsys.readouterr().out == ""


@pytest.mark.parametrize(
    ("model", "norm", "hinted"),
    [("resnet8", "average", True), ("resnet8", "recalibrate", False), ("cnn", "average", False)],
)
def test_a_batchnorm_model_averaged_as_it_is_gets_a_hint(
    model: str, norm: str, hinted: bool
) -> None:
    from simulation.command import _norm_hint
    from simulation.config import parse_sim_config

    config = {"model": model, "input_shape": [1, 28, 28], "num_classes": 10, "norm": norm}
    assert ("norm: recalibrate" in _norm_hint(parse_sim_config(config))) is hinted
