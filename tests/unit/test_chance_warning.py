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


@pytest.mark.parametrize(
    ("model", "extra", "noted"),
    [
        ("resnet8", {}, "set federated_eval"),
        ("resnet8", {"federated_eval": 0.1}, "understates theirs"),
        ("cnn", {}, None),
    ],
)
def test_fedbn_says_its_accuracy_is_of_averaged_statistics_at_any_accuracy(
    model: str, extra: dict[str, object], noted: str | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's FedBN run ended at 0.25 against 0.87 with recalibrate: no word said why (the
    chance warning is for 0.15 and below, and its hint named norm: average only)."""
    from simulation.command import _say_if_no_better
    from simulation.config import parse_sim_config

    config = {"model": model, "input_shape": [1, 28, 28], "num_classes": 10, "norm": "local"}
    summary = {"final_accuracy": 0.25, "test_majority_share": 0.1}
    _say_if_no_better(summary, parse_sim_config({**config, **extra}))
    out = capsys.readouterr().out
    if noted is None:
        assert "FedBN" not in out
    else:
        assert "norm: local (FedBN)" in out and noted in out, out
        assert ("set federated_eval" in out) is (not extra), out


@pytest.mark.parametrize(
    ("accuracy", "majority", "warned"),
    [(0.9112, 0.9112, True), (0.914, 0.9112, True), (0.95, 0.9112, False), (0.11, 0.11, False)],
)
def test_an_accuracy_no_better_than_the_commonest_class_is_a_warning(
    accuracy: float, majority: float, warned: bool, capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's 91 % zeros test set: 0.9112 in both rounds, the loss rising, and no word of it
    (the chance check knew only 1 / classes). Balanced data leaves it to the chance check."""
    from simulation.command import _say_if_majority

    _say_if_majority(accuracy, 10, majority)
    assert ("most common class" in capsys.readouterr().out) is warned


def test_the_summary_knows_the_test_sets_commonest_share() -> None:
    import numpy as np

    from simulation.report import majority_share
    from split_models.data import Dataset

    labels = np.array([0] * 9 + [1])
    assert majority_share(Dataset(np.zeros((10, 2), np.float32), labels, 2)) == 0.9
